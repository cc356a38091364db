"""`specdec generate` / `specdec models` on tiny models: output, stats, and one-line errors."""

import json
import subprocess
import sys

import pytest

from specdec.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def models(tiny_target_path, tiny_draft_path):
    return ["--target", str(tiny_target_path), "--draft", str(tiny_draft_path), "--n-ctx", "256"]


def test_generate_prints_text_and_stats(capsys, models):
    code, out, err = run(capsys, "generate", "Hello there", "--max-tokens", "16", "-k", "3", *models)
    assert code == 0
    assert out.strip()
    for key in ("tokens/s", "target calls", "mean accepted length", "acceptance rate", "acceptance by pos"):
        assert key in err


def test_compare_reports_ratio_and_match(capsys, models):
    code, out, err = run(capsys, "generate", "Hello there", "--max-tokens", "16", "--compare", *models)
    assert code == 0
    assert "speed-up" in err and "outputs match        yes" in err


def test_cascade_flag_gives_the_same_text(capsys, models):
    prompt = "one two three four five one two three four five one two"
    base = ("generate", prompt, "--raw", "--method", "draft", "-k", "4", "--max-tokens", "24", *models)
    args = (*base, "--json")
    code, plain, _ = run(capsys, *args)
    assert code == 0
    code, cascade, err = run(capsys, *args, "--cascade")
    assert code == 0
    assert json.loads(cascade)["token_ids"] == json.loads(plain)["token_ids"]
    assert "draft calls" in err  # the stats say what the cascade did
    code, _, err = run(capsys, *base, "--cascade")  # text output: the drafter line is there too
    assert code == 0 and "draft calls" in err


def test_json_stream_raw_and_ngram(capsys, models):
    code, out, _ = run(capsys, "generate", "abc abc abc", "--raw", "--method", "ngram", "--json",
                       "--max-tokens", "8", *models)
    assert code == 0
    data = json.loads(out)
    assert data["finish_reason"] in ("stop", "length") and len(data["token_ids"]) <= 8
    code, streamed, _ = run(capsys, "generate", "abc abc abc", "--raw", "--method", "ngram", "--stream",
                            "--max-tokens", "8", *models)
    assert code == 0 and streamed.rstrip("\n") == data["text"]


def test_prompt_from_file_and_stdin(capsys, models, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("Hello there")
    code, out_file, _ = run(capsys, "generate", "--file", str(f), "--max-tokens", "6", *models)
    assert code == 0
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there"))
    code, out_stdin, _ = run(capsys, "generate", "-", "--max-tokens", "6", *models)
    assert code == 0 and out_stdin == out_file


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["   "], "empty"),
        (["hi", "-k", "-1"], "num-speculative-tokens"),
        (["hi", "-k", "100000"], "num-speculative-tokens"),
        (["hi", "--temperature", "-1"], "--temperature must"),
        (["hi", "--temperature", "inf"], "--temperature must"),
        (["hi", "--temperature", "nan"], "--temperature must"),
        (["hi", "--seed", "-1"], "--seed must"),
        (["hi", "--threads", "0"], "--threads"),
        (["hi", "--threads", "-1"], "--threads"),
        (["hi", "--threads", "20000"], "--threads 20000 is more than 4x the"),
        (["hi", "--json", "--stream"], "--json"),
        (["hi", "--top-p", "0"], "--top-p must"),
        (["hi", "--top-p", "1.5"], "--top-p must"),
        (["hi", "--max-tokens", "0"], "--max-tokens must"),
        (["hi", "--min-tokens", "9", "--max-tokens", "4"], "--min-tokens must be in 0..--max-tokens (4)"),
        (["x" * 3000, "--raw", "--n-ctx", "64"], "context"),
        ([], "no prompt"),
    ],
)
def test_bad_input_one_line(capsys, models, extra, fragment):
    code, out, err = run(capsys, "generate", *extra, *models)
    assert code != 0
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_model_files(capsys, tmp_path, tiny_target_path):
    code, _, err = run(capsys, "generate", "hi", "--target", str(tmp_path / "missing.gguf"))
    assert code == 2 and "missing.gguf" in err and len(err.strip().splitlines()) == 1  # bad input: 2, as argparse
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    code, _, err = run(capsys, "generate", "hi", "--target", str(junk), "--method", "none")
    assert code != 0 and "GGUF" in err and len(err.strip().splitlines()) == 1


def test_vocab_mismatch_refused(capsys, tmp_path, tiny_target_path):
    from tiny_gguf import write_tiny_qwen2_gguf

    other = write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=5, extra_vocab=3)
    code, _, err = run(capsys, "generate", "hi", "--target", str(tiny_target_path), "--draft", str(other),
                       "--n-ctx", "512")
    assert code != 0 and "vocabularies" in err and len(err.strip().splitlines()) == 1


def test_console_script_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "hi", "--target", str(tmp_path / "nope.gguf")],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("specdec: error:")


def test_models_lists_known(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct" in out
    assert "not downloaded" in out


def test_unusable_cache_is_one_line(capsys, tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("SPECDEC_CACHE", str(not_a_dir / "sub"))
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {tmp_path}")
    code, _, err = run(capsys, "generate", "hi", "--method", "none")
    assert code == 1 and "SPECDEC_CACHE" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_download_failure_names_every_missing_model(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {tmp_path}")  # an empty index
    code, _, err = run(capsys, "generate", "hi")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "qwen2.5-coder-1.5b-instruct" in err and "qwen2.5-coder-0.5b-instruct" in err


def test_own_target_without_draft(capsys, tiny_target_path, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "empty"))  # the default draft must not be fetched
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {tmp_path}")
    base = ["generate", "abc abc abc", "--raw", "--max-tokens", "6", "--target", str(tiny_target_path),
            "--n-ctx", "256"]
    code, out, err = run(capsys, *base)  # auto: n-gram lookup and plain steps only
    assert code == 0 and out.strip() and "error" not in err
    code, _, err = run(capsys, *base, "--method", "draft")
    assert code == 2 and "--draft" in err and len(err.strip().splitlines()) == 1


def test_show_accepted_does_not_wrap(capsys, models, monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")
    code, out, _ = run(capsys, "generate", "Hello there " * 8, "--raw", "--max-tokens", "24", "--show-accepted",
                       "--method", "ngram", *models)
    plain_code, plain_out, _ = run(capsys, "generate", "Hello there " * 8, "--raw", "--max-tokens", "24",
                                   "--method", "ngram", *models)
    assert code == plain_code == 0 and out == plain_out


def test_model_names_pair_the_default_draft_with_the_default_target_only():
    from specdec.api import model_names
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    assert model_names(None, None, "auto") == (DEFAULT_TARGET, DEFAULT_DRAFT)
    assert model_names(DEFAULT_TARGET, None, "draft") == (DEFAULT_TARGET, DEFAULT_DRAFT)
    assert model_names(None, None, "ngram") == (DEFAULT_TARGET, None)
    assert model_names("my.gguf", None, "auto") == ("my.gguf", None)
    assert model_names("my.gguf", "d.gguf", "none") == ("my.gguf", "d.gguf")
    with pytest.raises(ValueError, match="draft="):  # the library names its API; the CLI says --draft
        model_names("my.gguf", None, "draft")


@pytest.mark.parametrize("command", ["generate", "serve", "check"])
def test_hf_backend_without_transformers_is_one_line(capsys, monkeypatch, tiny_target_path, command):
    import specdec.backends

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    for name in ("hf", "hf_loading"):  # imported by earlier tests: import them afresh
        monkeypatch.delitem(sys.modules, f"specdec.backends.{name}", raising=False)
        monkeypatch.delattr(specdec.backends, name, raising=False)
    prompt = [] if command == "serve" else ["hi"]
    code, _, err = run(capsys, command, *prompt, "--backend", "hf", "--target", str(tiny_target_path),
                       "--draft", str(tiny_target_path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("specdec: error: --backend hf needs transformers and torch: "
                          "pip install 'specdec-engine[hf]'")


@pytest.mark.parametrize("extra, fragment", [
    (["--drain-timeout", "-5"], "--drain-timeout must be 0 or more"),
    (["--drain-timeout", "nan"], "--drain-timeout must be 0 or more"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
])
def test_bad_serve_options_one_line(capsys, monkeypatch, tiny_target_path, extra, fragment):
    import specdec.cli.serve

    def refuse(args):
        raise AssertionError("the models were loaded despite a bad option")

    monkeypatch.setattr(specdec.cli.serve, "load_server", refuse)
    code, _, err = run(capsys, "serve", "--target", str(tiny_target_path), "--method", "ngram", *extra)
    assert code == 2 and fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_json_is_strict_when_nothing_was_drafted(capsys, models):
    code, out, _ = run(capsys, "generate", "Hello there", "--method", "none", "--json", "--max-tokens", "4", *models)

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    stats = json.loads(out, parse_constant=refuse)["stats"]
    assert code == 0 and stats["proposed"] == 0 and stats["acceptance_rate"] is None


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a C/POSIX locale reads stdin with the latter
def test_stdin_not_utf8_is_one_line(capsys, models, monkeypatch, errors):
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait \xff\xfe"), encoding="utf-8", errors=errors)
    monkeypatch.setattr(sys, "stdin", stdin)
    code, _, err = run(capsys, "generate", "-", "--max-tokens", "4", *models)
    assert code == 2 and err.startswith("specdec: error: cannot read the prompt from stdin: not UTF-8 text (")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("library, cli", [
    ("device= and dtype= apply to backend='hf'; llama.cpp runs GGUF files on the CPU",
     "--device and --dtype apply to --backend hf; llama.cpp runs GGUF files on the CPU"),
    ("device 'cuda' asked for, but torch sees no CUDA device here; use device='cpu'",
     "device 'cuda' asked for, but torch sees no CUDA device here; use --device cpu"),
    ("n_ctx 9 x 2 sequences = 18 KV cells is more than llama.cpp can address (16); choose a smaller n_ctx",
     "--n-ctx 9 x 2 sequences = 18 KV cells is more than llama.cpp can address (16); choose a smaller --n-ctx"),
    ("check needs speculation: choose method='draft' or 'ngram' with num_speculative_tokens >= 1",
     "check needs speculation: choose --method 'draft' or 'ngram' with -k/--num-speculative-tokens >= 1"),
    ("need n_samples >= 20, depth in 1..4 and alpha in (0, 1)", "need --samples >= 20, --depth in 1..4 and --alpha in (0, 1)"),
    ("suffix_depth must be in 1..256, got 0", "suffix_depth must be in 1..256, got 0"),  # whole words only
])
def test_library_errors_name_the_api_and_the_cli_translates(library, cli):
    """Library errors name parameters (issue 38); the one-line CLI error names the options instead."""
    from specdec.cli import cli_terms

    assert cli_terms(library) == cli and "--" not in library


def test_generate_takes_a_json_schema_a_regex_and_a_grammar(capsys, tmp_path, tiny_target_path, tiny_draft_path):
    """Issue 39: structured outputs from the command line; a bad schema, regex or file is one line."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                  "additionalProperties": False}))
    base = ["--target", str(tiny_target_path), "--draft", str(tiny_draft_path), "--n-ctx", "512", "--max-tokens", "40"]
    code, out, _ = run(capsys, "generate", "hi", *base, "--json-schema", str(schema))
    text = out.strip().splitlines()[0]
    assert code == 0 and text.startswith('{"a": ')
    code, out, _ = run(capsys, "generate", "hi", *base, "--regex", "[a-c]{4}")
    assert code == 0 and out.strip().splitlines()[0][:4].strip("abc") == ""
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "yes" | "no"')
    code, out, _ = run(capsys, "generate", "hi", *base, "--grammar", str(gbnf))
    assert code == 0 and out.strip().splitlines()[0] in ("yes", "no")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args in (["--json-schema", str(bad)], ["--regex", "("], ["--grammar", str(tmp_path / "none.gbnf")]):
        code, _, err = run(capsys, "generate", "hi", *base, *args)
        assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    with pytest.raises(SystemExit) as e:  # argparse's own one-line refusal
        main(["generate", "hi", *base, "--regex", "a", "--json-schema", str(schema)])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
