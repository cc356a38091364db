"""Structured outputs: a grammar (JSON schema, regular expression, Lark) that constrains what a request may
generate, on llguidance (the engine llama.cpp, vLLM and SGLang use).

The constraint is a mask over the vocabulary at each position: the target's distribution becomes
``p_c(x) ∝ p(x) * allowed(x)``, and speculation stays lossless with respect to ``p_c``: every row the
verifier reads is masked with the matcher advanced over the drafts before it, the draft model's ``q`` is
masked with the same states, drafts the grammar refuses are cut before they are scored, and the matcher is
rolled back to the accepted prefix after verification. Where the grammar allows exactly one continuation,
that token is certain: it can be drafted at no cost (:meth:`Constraint.forced`).

- :class:`GrammarSpec`: what a request asks for (frozen, validated at the edge: a bad schema is a
  ``ValueError`` naming the problem, before anything is reserved);
- :class:`Vocabulary`: the model's tokens as llguidance sees them (built once per engine);
- :class:`Constraint`: one request's matcher: masks, drafts' valid prefix, commit and rollback.

This module knows token ids, bytes and llguidance; not models, logits' meaning, or proposers.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np

from specdec.grammar_limits import check_json_schema, check_regex, check_rules

class GrammarError(ValueError):
    """A request's grammar cannot be followed: it matches no text, or it is too complex for the grammar
    engine's limits at some position (found while generating). The client's to fix."""


KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
"""Grammar kinds a request may give."""

JSON_OBJECT_SCHEMA = {"type": "object"}
"""``response_format: {"type": "json_object"}``: any JSON object."""

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON is laid out: on one line, ``{"a": 1, "b": [2, 3]}``. Whitespace the grammar does not leave to the
model is forced, so separators become free drafts; a model left to choose its whitespace can spend its
tokens on it (a small model may never close the object)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint.

    Attributes:
        kind: ``"json_schema"`` (``source``: the schema as JSON text), ``"json_object"`` (any object; no
            ``source``), ``"regex"`` (a regular expression the whole output matches), ``"gbnf"`` (llama.cpp's
            GBNF, converted to Lark when compiled: :meth:`from_gbnf`) or ``"lark"`` (a Lark
            grammar; llama.cpp's GBNF is converted by :meth:`from_gbnf`).
        source: The schema, expression or grammar text.

    Only what needs no compiler is checked here (the kind, JSON, and :mod:`specdec.grammar_limits`' bounds on
    depth, rule count and repetition, all linear in the text); whether llguidance can compile it is found by
    :meth:`Vocabulary.compile` (:class:`GrammarError`).

    Raises:
        ValueError: an unknown kind, a schema that is not a JSON object, or a grammar over a bound
            (:class:`~specdec.grammar_limits.GrammarTooLarge`, naming the limit).
    """

    kind: Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
    source: str = ""
    compiled: tuple = field(default=(), compare=False, repr=False)
    """``((vocabulary, matcher), ...)``: this grammar compiled for those vocabularies (:meth:`Vocabulary.compile`
    with a salt; a request's matchers are copies of these). Set by :meth:`with_compiled`, never by hand."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise ValueError(f"the grammar's source must be text, got {type(self.source).__name__}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the JSON schema is not JSON: {_one_line(e)}") from None
            except RecursionError:
                raise ValueError("the JSON schema is nested too deeply") from None
            if not isinstance(schema, dict):
                raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
            check_json_schema(schema)
        elif self.kind == "regex":
            check_regex(self.source)
        else:
            check_rules(self.source)

    @classmethod
    def checked(cls, kind: str, source: str) -> "GrammarSpec":
        """A spec whose checks already ran (in the process that sent it to a trial process): not again."""
        spec = object.__new__(cls)
        object.__setattr__(spec, "kind", kind)
        object.__setattr__(spec, "source", source)
        object.__setattr__(spec, "compiled", ())
        return spec

    def with_compiled(self, pairs: Sequence[tuple["Vocabulary", object]]) -> "GrammarSpec":
        """This spec carrying its compiled matchers (``(vocabulary, matcher)`` pairs), checks not run again."""
        spec = GrammarSpec.checked(self.kind, self.source)
        object.__setattr__(spec, "compiled", tuple(pairs))
        return spec

    @classmethod
    def json_schema(cls, schema: dict | str) -> "GrammarSpec":
        """A constraint to JSON matching ``schema`` (a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def from_text(cls, text: str) -> "GrammarSpec":
        """A constraint from a grammar's text: Lark (llguidance's dialect: a ``start:`` rule or a
        ``%llguidance`` header) or else llama.cpp's GBNF (``root ::= ...``).

        Raises:
            ValueError: when the text is neither, or is over a bound.
        """
        return cls("lark", text) if is_lark(text) else cls.from_gbnf(text)

    @classmethod
    def from_gbnf(cls, gbnf: str) -> "GrammarSpec":
        """A constraint from llama.cpp's GBNF grammar text, converted to Lark (by llguidance's converter) when
        it is compiled: a GBNF grammar that does not convert is a :class:`GrammarError` then.

        Raises:
            ValueError: when the text is over a bound.
        """
        return cls("gbnf", gbnf)

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps(JSON_OBJECT_SCHEMA), defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
            except RecursionError:
                raise ValueError("the GBNF grammar is nested too deeply") from None
            except Exception as e:  # the converter raises its own types
                raise ValueError(f"the GBNF grammar does not convert: {_one_line(e)}") from None
        return LLMatcher.grammar_from_lark(self.source)


_LARK = re.compile(r"^[ \t\r\f\v]*(?:%llguidance\b|start[ \t\r\f\v]*:)", re.MULTILINE)


def is_lark(text: str) -> bool:
    """Whether a grammar's text is Lark (a line that starts, after blanks, with ``start:`` or
    ``%llguidance``) rather than GBNF, in time linear in ``len(text)`` (llguidance's own check lets ``\\s``
    run across newlines: quadratic in blank lines)."""
    return _LARK.search(text) is not None


_ENGINE_LIMITS = (
    ("Current row has", "too many alternatives at one position (more than the grammar engine's 2,000); "
                        "fewer choices, or one regular expression instead of many alternatives"),
    ("too many expressions", "too many or too complex regular expressions for the grammar engine's lexer"),
    ("lexer states", "the grammar's regular expressions need too many lexer states"),
    ("fuel", "a regular expression too costly to evaluate"),
    ("Earley items", "too many parser items at one position (the grammar is too ambiguous)"),
    ("grammar size", "the grammar is too large"),
)


def _engine_words(detail: str) -> str:
    """llguidance's message in our words: a known limit said plainly, an internal failure (a panic) as such,
    a grammar error (its parser's) as its first line; never its internal state or backtrace."""
    if "panic" in detail.lower():
        return "the grammar engine failed on it (an internal error)"
    for marker, words in _ENGINE_LIMITS:
        if marker in detail:
            return words
    lines = [line for line in detail.replace("<non-verbose/>", "").splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    head = lines[0]
    if head.rstrip().endswith(":"):  # a regex's error: its reason is the "error: ..." line below the diagram
        reason = next((line.strip() for line in lines[1:] if line.strip().startswith("error:")), None)
        head = f"{head} {reason[len('error:'):].strip()}" if reason else head.rstrip().rstrip(":")
    return _one_line(head)


def _one_line(e: BaseException | str) -> str:
    """An error's text on one line, without llguidance's internals (``<state>``, ``<backtrace>``), clipped."""
    text = str(e)
    for cut in ("<state>", "<backtrace>", "stack backtrace", "\nBacktrace"):
        text = text.split(cut)[0]
    return " ".join(text.split())[:300]


class _Tokens:
    """What llguidance's ``TokenizerWrapper`` reads: the tokens' bytes, the special ids, end of
    generation, and a tokenize function."""

    def __init__(self, tokens: list[bytes], eos: int, special: Sequence[int], tokenize: Callable[[bytes], list[int]]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = list(special)
        self._tokenize = tokenize

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenize(text)


class Vocabulary:
    """A model's vocabulary for llguidance, built once per engine (~1 s for 151,936 tokens), and the
    grammars compiled for it (a bounded cache: see :meth:`compile`).

    Args:
        tokens: ``[V]`` the bytes of each token (special tokens: their text).
        vocab_size: ``V``: the real vocabulary (ids ``0..V-1``).
        eog_ids: Ids that end generation: allowed where the grammar can end, refused elsewhere.
        tokenize: ``bytes -> ids``, the model's tokenizer (llguidance tokenizes forced text with it); None:
            llguidance's greedy tokenization over ``tokens`` (a trial process, which has no model).
        special_ids: Control tokens (never allowed inside a grammar's text).
        cache_size: Most compiled grammars kept.
    """

    def __init__(self, tokens: Sequence[bytes], vocab_size: int, eog_ids: frozenset[int],
                 tokenize: Callable[[bytes], list[int]] | None, special_ids: Sequence[int] = (),
                 cache_size: int = 64):
        from llguidance import LLTokenizer, TokenizerWrapper

        self.vocab_size = vocab_size
        self.eog_ids = frozenset(eog_ids)
        eos = min(self.eog_ids) if self.eog_ids else 0
        self._eog = np.array(sorted(self.eog_ids), dtype=np.int64)  # [n_eog] int64, for the masks
        self._payload = _payload(tokens, vocab_size, self.eog_ids, special_ids)
        tokens, special = self._payload["tokens"], self._payload["special_ids"]
        if tokenize is None:  # greedy over the tokens: a tokenizer only to tokenize with
            greedy = LLTokenizer(TokenizerWrapper(_Tokens(tokens, eos, special, lambda b: [])), n_vocab=vocab_size)
            tokenize = lambda text: greedy.greedy_tokenize(text.decode("utf-8", "replace"))  # noqa: E731
        wrapper = TokenizerWrapper(_Tokens(tokens, eos, special, tokenize))
        self.tokenizer = LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=sorted(self.eog_ids) or None)
        self._cache: "collections.OrderedDict[str, object]" = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.trials = None  # TrialWorkers, once a server asks for trials (compile(..., budget_s=...))

    # -- compiling ---------------------------------------------------------------------------------
    def payload(self) -> dict:
        """What a trial process needs to rebuild this vocabulary (:meth:`from_payload`)."""
        return self._payload

    @classmethod
    def from_payload(cls, payload: dict) -> "Vocabulary":
        """The vocabulary of :meth:`payload`, tokenizing greedily (for a trial process)."""
        return cls(payload["tokens"], payload["vocab_size"], frozenset(payload["eog_ids"]), None,
                   payload["special_ids"], cache_size=0)

    def build_matcher(self, spec: GrammarSpec):
        """A fresh llguidance matcher for ``spec``, its first mask computed, under
        :data:`PARSER_LIMITS`; call it on a large stack (:func:`~specdec.grammar_compile.on_large_stack`).

        Raises:
            GrammarError: when llguidance refuses the grammar, or it matches no text.
        """
        from llguidance import LLMatcher, LLParserLimits

        try:
            grammar = spec.grammar()
        except (ValueError, RuntimeError) as e:  # llguidance's converters raise these for a bad source
            raise GrammarError(f"the grammar is invalid: {_one_line(e)}") from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
        if matcher.is_error():
            raise GrammarError(f"the grammar is invalid: {_engine_words(matcher.get_error())}")
        Constraint(self, None, matcher.deep_copy())  # the first mask: the grammar can start
        return matcher

    def cached(self, spec: GrammarSpec, salt: str = ""):
        """The matcher :meth:`compile` cached for ``spec`` and ``salt``, or None (a dictionary look-up)."""
        with self._lock:
            hit = self._cache.get(_cache_key(spec, salt))
        return None if isinstance(hit, GrammarError) else hit

    def compile(self, spec: GrammarSpec, budget_s: float | None = None, salt: str = ""):
        """The compiled matcher of ``spec`` (cached; a fresh copy for each :meth:`constraint`).

        Args:
            spec: The constraint.
            budget_s: With a budget (a server), a grammar not seen before is first compiled in a trial
                process (:mod:`specdec.grammar_compile`) that is killed past ``budget_s`` seconds; a crash or
                a timeout there is this grammar's :class:`GrammarError`. ``None``: compiled here directly
                (a grammar the caller wrote).
            salt: Whose cache entry (a server's tenant): a grammar compiled for one salt is compiled again
                for another, so that how fast a grammar is accepted never shows whether another tenant sent
                it.

        Raises:
            GrammarError: a grammar llguidance refuses, one that matches no text, or one over the budget.
        """
        from specdec.grammar_compile import TrialWorkers, on_large_stack

        key = _cache_key(spec, salt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, GrammarError):
            raise hit
        if hit is not None:
            return hit
        if budget_s is not None:
            with self._lock:
                if self.trials is None:
                    self.trials = TrialWorkers(self._payload)
            failure = self.trials.trial(spec, budget_s)
            if failure is not None:  # not cached: a timeout on a busy machine may pass later
                raise GrammarError(failure)
        try:
            matcher = on_large_stack(lambda: self.build_matcher(spec))
        except GrammarError as e:  # cached: the same grammar fails the same way
            matcher = e
        if self._cache_size:
            with self._lock:
                self._cache[key] = matcher
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(matcher, GrammarError):
            raise matcher
        return matcher

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh matcher for one request (compiled once per grammar: :meth:`compile`).

        Raises:
            GrammarError: when llguidance cannot build the matcher (a grammar too large, say).
        """
        mine = next((m for v, m in spec.compiled if v is self), None)
        return Constraint(self, spec, (mine or self.compile(spec)).deep_copy())

    def close(self) -> None:
        """Stop the trial processes, if any."""
        if self.trials is not None:
            self.trials.close()


def _cache_key(spec: GrammarSpec, salt: str) -> str:
    return f"{salt}\0{spec.kind}\0{spec.source}"


PARSER_LIMITS = {"verbose_errors": False}
"""llguidance's per-grammar limits (``LLParserLimits``): its defaults bound a mask's work (lexer fuel, Earley
items per step) and the grammar's size; errors without its internal state (a client's message, not a
debugging dump)."""

def _payload(tokens: Sequence[bytes], vocab_size: int, eog_ids, special_ids) -> dict:
    """A vocabulary's content (what a trial process rebuilds it from, and what tells two models' apart)."""
    eog = sorted(eog_ids)
    return {"tokens": list(tokens[:vocab_size]), "vocab_size": vocab_size, "eog_ids": eog,
            "special_ids": sorted(set(special_ids) | set(eog))}


_VOCAB_OF: "weakref.WeakKeyDictionary" = None  # backend -> its Vocabulary, built on first use
_VOCAB_LOCK = threading.Lock()


def vocabulary_of(backend, vocab_size: int, like: Vocabulary | None = None) -> Vocabulary:
    """The :class:`Vocabulary` of a model backend (a :class:`~specdec.backends.base.Backend`: its
    ``token_bytes``, ``tokenize``, ``eog_ids`` and ``control_token_texts``), built on first use and kept while
    the backend lives; control tokens are special (never part of a grammar's text).

    Args:
        backend: The model's backend.
        vocab_size: ``V``, its real vocabulary (padding rows excluded).
        like: Another model's vocabulary (a draft's target, which outlives none of its drafts): taken as this
            backend's too when the tokens are the same, so that both share its compiled grammars.
    """
    global _VOCAB_OF
    import weakref

    with _VOCAB_LOCK:
        if _VOCAB_OF is None:
            _VOCAB_OF = weakref.WeakKeyDictionary()
        vocab = _VOCAB_OF.get(backend)
        if vocab is not None and vocab.vocab_size == vocab_size:
            return vocab
        tokens = [backend.token_bytes(i) for i in range(vocab_size)]
        control = {t.encode() for t in backend.control_token_texts()}
        special = [i for i, b in enumerate(tokens) if b in control]  # never text inside a grammar
        eog = frozenset(t for t in backend.eog_ids if t < vocab_size)
        if like is not None and like.payload() == _payload(tokens, vocab_size, eog, special):
            vocab = like
        else:
            vocab = Vocabulary(tokens, vocab_size, eog, lambda text: backend.tokenize(text.decode("utf-8", "replace")),
                               special)
        _VOCAB_OF[backend] = vocab
        return vocab


class Constraint:
    """One request's grammar state: the tokens committed so far, masks for the positions to be scored.

    Args:
        vocab: The engine's :class:`Vocabulary`.
        spec: What the request asked for.
        matcher: Its fresh llguidance matcher (:meth:`Vocabulary.constraint` makes one).

    Raises:
        GrammarError: when the grammar matches no text.
    """

    def __init__(self, vocab: Vocabulary, spec: GrammarSpec | None, matcher):
        self.vocab, self.spec, self.matcher = vocab, spec, matcher
        self._words = (vocab.vocab_size + 31) // 32
        if not self.matcher.is_accepting() and not self.mask().any():
            raise GrammarError("the grammar matches no text (no token can start it)")

    # -- masks -----------------------------------------------------------------------------------
    def mask(self) -> np.ndarray:
        """``[V] bool``: the tokens allowed next (end-of-generation ids where the grammar can end, and only
        they once it has ended: a row after the end is never used, but must hold a token)."""
        if self.matcher.is_stopped():
            return self._end_only()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        if self.matcher.is_error():
            raise GrammarError(self._failure())
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab.vocab_size].astype(bool)
        eog = self.vocab._eog
        if self.matcher.is_accepting():  # llguidance allows its own eos there; every eog id ends the text
            allowed[eog] = True
        elif allowed[eog].any():  # a grammar naming an end token (Lark's <|im_end|>) mid-text: it would end
            allowed[eog] = False  # the output there, unmatched; the text cannot hold it
            if not allowed.any():
                raise GrammarError("the grammar puts an end-of-generation token inside its text, which would "
                                   "end the output before the grammar is complete; remove it")
        return allowed

    def masks(self, drafts: Sequence[int], start: int = 0, n: int | None = None) -> np.ndarray:
        """``[n, V] bool``: the masks of rows ``start .. start+n-1`` of a call that scores after ``drafts``
        (row ``i``: after the first ``i`` drafts; default all ``len(drafts) + 1`` rows). The drafts must be
        accepted by the grammar (:meth:`valid_prefix`) up to the last row asked; a row after a refused draft
        (never reached: the refused draft has no mass) allows the end only. The matcher is back where it was
        afterwards."""
        n = len(drafts) + 1 - start if n is None else n
        rows, valid, consumed = [], 0, 0  # drafts accepted, tokens the matcher consumed (to roll back)
        for i in range(start + n):
            if i >= start:
                rows.append(self.mask() if valid == i else self._end_only())
            if i < len(drafts) and i < start + n - 1 and valid == i:
                took = self._consume(drafts[i])
                if took is not None:
                    valid, consumed = valid + 1, consumed + took
        self.rollback(consumed)
        return np.stack(rows)

    def _failure(self) -> str:
        """What the matcher's error state means, in one line."""
        detail = self.matcher.get_error().split("<state>")[0]
        if "NoExtensionBias" in detail or "NoExtensionBias" in str(self.matcher.stop_reason()):
            return "the grammar matches no text from here (no token can continue it)"
        return f"the grammar engine gave up on this grammar here: {_engine_words(detail)}"

    def _end_only(self) -> np.ndarray:
        allowed = np.zeros(self.vocab.vocab_size, dtype=bool)
        allowed[self.vocab._eog] = True
        return allowed

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (end-of-generation included where it can
        end); the matcher is unchanged."""
        return self.matcher.validate_tokens(self._ids(tokens))

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows as the only continuation from here (a key, a brace, a
        quote): certain drafts, at no cost."""
        return list(self.matcher.compute_ff_tokens())[:limit]

    # -- state -----------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (those the verifier accepted, and the one it added).

        Raises:
            ValueError: for a token the grammar refuses (a bug: committed tokens were sampled masked).
        """
        for t in tokens:
            if self._consume(t) is None:
                raise GrammarError(self._failure() if self.matcher.is_error()
                                   else f"token {t} does not fit the grammar (a bug: rows are sampled masked)")

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens consumed."""
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"the grammar matcher could not roll back {n} tokens")

    @property
    def finished(self) -> bool:
        """True when the grammar can take nothing more (the output is complete)."""
        return self.matcher.is_stopped()

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        """Token ids as llguidance knows them: every end-of-generation id is its eos."""
        eos = self.vocab.tokenizer.eos_token
        return [eos if t in self.vocab.eog_ids else int(t) for t in tokens]

    def _consume(self, token: int) -> int | None:
        """Consume one token if the grammar accepts it: the tokens the matcher took (0 or 1: an end of
        generation after the grammar has ended by itself is accepted without one), or ``None`` when refused.
        The matcher never enters its error state (llguidance's would last)."""
        m = self.matcher
        if token in self.vocab.eog_ids:
            if m.is_stopped():
                return 0
            return 1 if m.is_accepting() and m.consume_token(self.vocab.tokenizer.eos_token) else None
        return 1 if m.try_consume_tokens([int(token)]) == 1 else None


def serve_trials(fd: int, stack_bytes: int) -> None:
    """A trial process (:class:`~specdec.grammar_compile.TrialWorkers`): rebuild the vocabulary sent first,
    then compile each ``(kind, source)`` sent, answering None or the error's message."""
    from multiprocessing.connection import Connection

    from specdec.grammar_compile import on_large_stack

    import os

    try:  # behind the server's own threads: a slow grammar takes the cores streams leave
        os.nice(10)
    except OSError:
        pass
    conn = Connection(fd)
    try:
        vocab = Vocabulary.from_payload(conn.recv())
    except Exception as e:  # reported to the parent, which refuses the trial
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:
            return
        try:
            spec = GrammarSpec.checked(kind, source)  # the parent checked it
            on_large_stack(lambda: vocab.build_matcher(spec), stack_bytes)
            conn.send(None)
        except ValueError as e:  # GrammarError included: the parent words it
            conn.send(str(e))
