"""In-process closed-loop serving of a serving-bench workload, methods alternated on one engine (a record of
the measurement in docs/bench/README.md, "On an AMX machine"; not part of the package). `auto-old`: auto with
every plain step counted whole towards the next probe (the rule before the probe share); `-nowait` after a
method: new requests never wait for another's prefill of their prompt (the rule before that change).
Per step it logs the step wall time, the target call, drafted/accepted tokens and probes.
Run: python3 docs/bench/serving-amx/inprocess.py --workload single --c 8 --rounds 2 --methods none,auto-old,auto
--diag adds the measurements behind "Drafts in a busy pass" (docs/bench/README.md): per step the backend's
eval time alone and the tokens in the sequences' contexts (steps-<tag>.json in /tmp/scratch, for the
regressions there), ik_llama.cpp's compaction time, per (kind, k, batch size) what auto expected of its
drafts against what they earned, and the shared-call draft cost at the end; a method suffix -nobigN makes
auto take plain steps in calls of N or more sequences; -marginG makes auto draft in a shared call only where
its predicted gain (hybrid._gain, in the request's own plain tokens a call) is at least G.
Run: python3 docs/bench/serving-amx/inprocess.py --diag --workload multi-turn --c 8 --rounds 2 --methods none,auto"""
import numpy as np
import argparse, json, os, queue, threading, time, sys, collections
from specdec.api import load_engine
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler
from specdec.bench.workloads import build_jobs
import specdec.step as stepmod

p = argparse.ArgumentParser()
p.add_argument("--workload", default="multi-turn")
p.add_argument("--c", type=int, default=4)
p.add_argument("--jobs", type=int, default=8)
p.add_argument("--max-tokens", type=int, default=64)
p.add_argument("--methods", default="none,auto")
p.add_argument("--rounds", type=int, default=1)
p.add_argument("--backend", default=None)
p.add_argument("--out", default=None)
p.add_argument("--diag", action="store_true")
a = p.parse_args()

n_ctx = 4096
engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=n_ctx, n_seq_max=3 * 8, kv_cells=n_ctx * 8,
                     n_threads=2, progress=False, backend=a.backend)
engine.enable_prefix_cache(8, 8192 * 4)
sched = Scheduler(engine, max_running=8, max_waiting=64,  # CHUNK=n: n prompt tokens a call (0: automatic)
                  prefill_chunk_tokens=int(os.environ.get("CHUNK", "0")))

LOG = []
orig = stepmod.speculative_step
EVAL = [0.0]
def logged(target, seqs, cost=None, prefill_chunk=None):
    if not getattr(target, '_timed', False):
        _ev = target.eval
        def ev(batch):
            t = time.perf_counter(); out = _ev(batch); EVAL[0] = time.perf_counter() - t; return out
        target.eval = ev; target._timed = True
    EVAL[0] = 0.0
    t0 = time.perf_counter()
    pre = {s: (s.prefilled) for s in seqs}
    rep = orig(target, seqs, cost, prefill_chunk)
    wall = time.perf_counter() - t0
    drafted = sum(len(o.proposal.tokens) for o in rep.outcomes)
    dsec = sum(o.proposal.draft_cost.seconds for o in rep.outcomes if o.proposal.draft_cost)
    dcatch = sum(o.proposal.draft_cost.catchup for o in rep.outcomes if o.proposal.draft_cost)
    acc = sum(o.accepted for o in rep.outcomes)
    n_dec = len(rep.outcomes)
    n_pre = sum(1 for s in seqs if not pre[s])
    LOG.append(dict(eval_s=EVAL[0], kv=sum(len(x.context) for x in seqs), wall=wall, call_n=rep.call.n_tokens if rep.call else 0, call_s=rep.call.seconds if rep.call else 0,
                    n_dec=n_dec, n_pre=n_pre, drafted=drafted, accepted=acc, dsec=dsec, dcatch=dcatch,
                    kinds=[o.proposal.kind for o in rep.outcomes if o.proposal.tokens]))
    return rep
stepmod.speculative_step = logged
from specdec.proposers import hybrid as hyb
PROBES = [0, 0]
_orig_probe = hyb.HybridProposer._probe
def _probe(self, *a, **k):
    c = _orig_probe(self, *a, **k)
    if c is not None:
        PROBES[0] += 1
        PROBES[1] += c.k
    return c
hyb.HybridProposer._probe = _probe
OLD = [False]
_orig_sp = hyb.ProbeSchedule.should_probe
def _sp(self, share=1.0):
    return _orig_sp(self, 1.0 if OLD[0] else share)
hyb.ProbeSchedule.should_probe = _sp
from specdec.backends.cache import SequenceCache
NOWAIT = [False]
_orig_wait = SequenceCache.should_wait
SequenceCache.should_wait = lambda self, *a: False if NOWAIT[0] else _orig_wait(self, *a)
import specdec.engine as engmod
engmod.speculative_step = logged


import specdec.backends.ik_llama_cpp as ikmod
COMPACT = [0.0, 0]
TALLY = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # n, predicted committed, realized committed, predicted gain
NOBIG = [0]
if a.diag:
    # ---- diagnostics: compaction time; predicted vs realized per kind / k / batch size
    _oc = ikmod.IkLlamaCppBackend._compact
    def _compact(self):
        if self._holes:
            t = time.perf_counter(); _oc(self); COMPACT[0] += time.perf_counter() - t; COMPACT[1] += 1
        else:
            _oc(self)
    ikmod.IkLlamaCppBackend._compact = _compact
    _oca = hyb.HybridProposer._choose_auto
    def _choose(self, *a, **k):
        c = _oca(self, *a, **k)
        if c.k:
            plain = self.cost.plain(a[4], self.cost.load)
            self._diag = (c, self.cost.load.sequences + 1, hyb._gain(c, plain))
        else:
            self._diag = None
        return c
    hyb.HybridProposer._choose_auto = _choose
    _oobs = hyb.HybridProposer.observe
    def _obs(self, outcome):
        d = getattr(self, "_diag", None)
        if d is not None and outcome.proposal.kind is not None:
            c, nseq, gain = d
            prop, acc = outcome.main
            kb = "1" if c.k == 1 else "2-4" if c.k <= 4 else "5-8" if c.k <= 8 else "9+"
            bb = "1" if nseq == 1 else "2-4" if nseq <= 4 else "5+"
            key = (outcome.proposal.kind, kb, bb, "probe" if c.probe else "")
            t = TALLY[key]; t[0] += 1; t[1] += c.tokens; t[2] += acc + 1; t[3] += gain
            self._diag = None
        _oobs(self, outcome)
    hyb.HybridProposer.observe = _obs

MARGIN = [0.0]
_ocm = hyb.HybridProposer._choose_auto
def _choose_variant(self, *args, **kw):
    """-nobigN: a plain step in calls of N+ sequences; -marginG: no shared-call draft gaining under G."""
    load = self.cost.load
    if NOBIG[0] and load.sequences + 1 >= NOBIG[0]:
        self._diag = None
        return self.cost.plain(args[4], load)
    c = _ocm(self, *args, **kw)
    if MARGIN[0] and c.k and not c.probe and load.sequences > 0:
        plain = self.cost.plain(args[4], load)
        if hyb._gain(c, plain) < MARGIN[0]:
            self._diag = None
            return plain
    return c
hyb.HybridProposer._choose_auto = _choose_variant

def run_cell(method, tag):
    label = method
    jobs = [j.tagged(tag) for j in build_jobs(a.workload, a.jobs)]
    q = queue.Queue()
    for j in jobs: q.put(j)
    OLD[0] = method.endswith("-old")
    NOWAIT[0] = method.endswith("-nowait")
    NOBIG[0] = int(method.split("-nobig")[1]) if "-nobig" in method else 0
    MARGIN[0] = float(method.split("-margin")[1]) if "-margin" in method else 0.0
    method = method.split("-nobig")[0].split("-margin")[0]
    spec = SpecConfig(method=method.removesuffix("-old").removesuffix("-nowait"))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    toks = [0]; ttft = []; lock = threading.Lock()
    def client():
        while True:
            try: job = q.get_nowait()
            except queue.Empty: return
            msgs = [] if job.system is None else [{"role": "system", "content": job.system}]
            for turn in job.turns:
                msgs.append({"role": "user", "content": turn})
                ids = engine.encode_chat(msgs)
                t0 = time.perf_counter(); first = None; text = []; words = []
                for ch in sched.stream(ids, params, spec):
                    if first is None and ch.token_ids: first = time.perf_counter() - t0
                    text.extend(ch.token_ids); words.append(ch.text or '')
                with lock:
                    toks[0] += len(text); ttft.append(first)
                msgs.append({"role": "assistant", "content": ''.join(words)})
    LOG.clear(); PROBES[:] = [0, 0]; COMPACT[:] = [0.0, 0]; TALLY.clear()
    t0 = time.perf_counter()
    ths = [threading.Thread(target=client) for _ in range(a.c)]
    for t in ths: t.start()
    for t in ths: t.join()
    wall = time.perf_counter() - t0
    steps = list(LOG)
    agg = collections.Counter()
    for s in steps:
        for k in ("step_wall", "call_s", "dsec", "drafted", "accepted", "n_dec", "call_n", "dcatch"): agg[k] += s["wall" if k == "step_wall" else k]
        if s["drafted"]: agg["steps_draft"] += 1; agg["wall_draft"] += s["wall"]
        if s["n_pre"]: agg["steps_pre"] += 1; agg["wall_pre"] += s["wall"]
        if s["n_pre"] and s["drafted"]: agg["steps_pre_draft"] += 1
    ttft.sort()
    if a.diag:
        for key in sorted(TALLY):
            n, pe, re_, g = TALLY[key]; print('   ', key, 'n', n, 'pred E %.2f real %.2f gain %.3f' % (pe/n, re_/n, g/n))
    agg['compact_s'] = COMPACT[0]; agg['compacts'] = COMPACT[1]
    if a.diag:
        os.makedirs('/tmp/scratch', exist_ok=True)
        json.dump(steps, open(f'/tmp/scratch/steps-{tag.strip("[]")}.json', 'w'))
    return dict(method=tag if a.diag else label, wall=wall, tokens=toks[0], tps=toks[0] / wall, ttft_p50=ttft[len(ttft)//2], steps=len(steps), probes=PROBES[0], probe_tokens=PROBES[1], **agg)

res = []
for r in range(a.rounds):
    for m in a.methods.split(","):
        out = run_cell(m, f"[r{r}-{m}-{time.time():.0f}]")
        res.append(out)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
sched.close()
if a.out: json.dump(res, open(a.out, "w"), indent=1)
snap = engine.cost.target[True].snapshot()
print("S:", {n: round(s * 1000, 1) for n, s in list(snap["S"].items())[:12]}, "counts", list(snap["count"].items())[:12])
print("draft:", {k: (v[0].snapshot(), v[1].snapshot()) for k, v in engine.cost.draft_timing.items()})
sh = engine.cost.shared[True]
if a.diag:
    print("beta", sh.extension_seconds(), "sdd", sh._sdd, "P(m)", {int(m): round(float(sh.plain.mean[m])*1000, 1) for m in np.flatnonzero(sh.plain.count)}, {int(m): int(sh.plain.count[m]) for m in np.flatnonzero(sh.plain.count)})
