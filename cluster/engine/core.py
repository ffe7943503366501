"""The Engine: request lifecycle on the driver. It owns the scheduler and the worker
group; each `step()` sends one StepPlan to every rank, checks that the ranks agree
(digests), applies the emitted tokens and finishes sequences on EOS, stop strings,
max_tokens or the context limit."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time

from cluster.config import Config
from cluster.engine.detokenizer import Decoder, find_stop
from cluster.engine.executor import make_worker_group
from cluster.engine.request import QueueFullError, RequestError, RequestOutput, RequestParams, Sequence, Status
from cluster.engine.scheduler import Scheduler
from cluster.engine.stats import EngineStats
from cluster.engine.time_model_link import TimeModelLink, make_time_model_link
from cluster.engine.trace import TraceWriter
from controller.policy import MODES
from controller.probes import PLAIN_RUN
from controller.registry import STEADY_CATCHUP
from controller.samples import SETTLE_STEPS, StepSample
from controller.time_model import TimeModel
from workers.plan import SamplingParams, StepResult
from workers.sampler import sample_seed
from workers.worker import check_model_dirs

log = logging.getLogger("adaspec.engine")
SEED_BITS = 63  # a request without a seed gets one drawn from the OS
# Of a run of decode steps that draft nothing, the time-model registry gets the first PLAIN_RUN (a plain probe's
# stretch among drafting steps goes in whole) and every PLAIN_SAMPLE_EVERY-th after them. Each sample had cost its
# share of the registry's work, refits included, in the step loop: standing down at batch 4 (1.7 ms steps) the
# registry took 0.9% of the time, and adaptive ran 1.9% behind plain decoding on the same steps (1.0% with no
# samples at all). A plain step's time repeats itself: a sixteenth of them keep the fit. With a quarter, standing
# down at 8 sequences (every request at once) the registry's calls took 3.4 us a step on average, a refit nearly
# every round (each round's drain of small batches, which the linear model fits worst, read as drift); with a
# sixteenth 1.0 us (DESIGN.md section 4).
PLAIN_SAMPLE_EVERY = 16
# Of a run of steps that draft, it gets every DRAFT_SAMPLE_EVERY-th, and every one that first caught up on more than
# a steady step's tokens (what the catch-up's cost is fitted on: controller/catchup.py). At batch 1, where every step
# drafts, the registry's calls and refits had taken 8-22 ms of a 2 s round in the step loop (0.4-1%) with each one.
# Its first SAMPLE_ALL samples it gets every step that drafts: the first fits come as soon as before.
DRAFT_SAMPLE_EVERY = 4
SAMPLE_ALL = 1024


class RankDivergenceError(RuntimeError):
    """Ranks computed different decisions or tokens for the same step."""


class Engine:
    def __init__(self, cfg: Config, workers=None, tokenizer=None):
        self.cfg = cfg
        self.arch = check_model_dirs(cfg.model, cfg.speculative, cfg.parallel.tp_size)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.target)
        self.decoder = Decoder(self.tokenizer) if self.tokenizer is not None else None
        self.eos_ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # drafts run up to k positions past the last token: keep them inside the position table
        self.max_model_len = min(cfg.model.max_model_len, self.arch.max_position_embeddings - cfg.speculative.k - 1)
        self.workers = workers if workers is not None else make_worker_group(cfg)
        self.scheduler = Scheduler(cfg.cache.num_blocks, cfg.cache.block_size, cfg.engine.max_num_seqs,
                                   cfg.engine.max_prefill_tokens, cfg.speculative.k, self.max_model_len,
                                   cfg.engine.prefill_order, cfg.engine.prefill_max_wait_steps)
        adaptive = cfg.speculative.adaptive.enabled and cfg.speculative.enabled
        self.time_models: TimeModelLink | None = self._start_time_models() if adaptive else None
        self.time_model_version = self.time_models.report().version if self.time_models else 0
        self.mode = "adaptive" if self.time_models else "static"
        self.seqs: dict[int, Sequence] = {}
        self.stats = EngineStats()
        self._failures = 0  # consecutive worker-group recoveries without a completed step
        self._ids = itertools.count()
        self._requests = itertools.count()
        self._step_end = 0.0  # when the last step returned (perf_counter s), 0: none since an empty one
        self._plain_run = 0  # decode steps that drafted nothing since the last that drafted (PLAIN_SAMPLE_EVERY)
        self._draft_run = 0  # ... and that drafted since the last that did not (DRAFT_SAMPLE_EVERY)
        self._sampled = 0  # decode steps the registry got (SAMPLE_ALL)
        self._drafted = False  # some decode step has drafted (before one, no plain step is settling after it)
        self.tracer = TraceWriter(cfg.engine.trace_path, cfg.engine.trace_label) if cfg.engine.trace_path else None

    def _start_time_models(self) -> TimeModelLink:
        """Time model v1 from the startup sweep (or its cache), installed on every rank,
        and the link to the registry that refits it online."""
        from cluster.engine.sweep import load_or_sweep

        adaptive = self.cfg.speculative.adaptive
        model, samples = load_or_sweep(self.workers, self.cfg) if adaptive.profile_on_start else (TimeModel(1), [])
        model = dataclasses.replace(model, version=1)
        self.workers.install_time_model(model)
        return make_time_model_link(self.workers, adaptive.refit_every, model, samples, adaptive.time_model)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: RequestParams, request_id: str | None = None,
                    oracle_ids: list[int] | None = None) -> str:
        params.validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        if any(not 0 <= t < self.arch.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.arch.vocab_size})", "prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: together more "
                               f"than the context length {self.max_model_len}", "prompt")
        if len(self.scheduler.waiting) >= self.cfg.engine.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.cfg.engine.max_waiting} requests); retry later")
        request_id = request_id or f"req-{next(self._requests)}"
        seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)  # reported in the outputs
        samples = []
        for i in range(params.n):
            sampling = SamplingParams(params.temperature, params.top_p, params.top_k, seed=sample_seed(seed, i))
            seq = Sequence(next(self._ids), request_id, i, ids, params, sampling, seed=seed, oracle_ids=oracle_ids)
            self.seqs[seq.seq_id] = seq
            samples.append(seq)
        samples[0].forks = samples[1:]  # prefilled once: the others fork from sample 0's prompt
        self.scheduler.add(samples[0])
        return request_id

    def abort(self, request_id: str) -> int:
        """Drop every sample of a request (its client went away); returns how many were live."""
        seqs = [s for s in self.seqs.values() if s.request_id == request_id]
        for seq in seqs:
            seq.finish_reason = "abort"
            del self.seqs[seq.seq_id]
        self.scheduler.abort(seqs)
        self.stats.aborted += len(seqs)
        return len(seqs)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send token ids", "prompt")
        return self.tokenizer(text)["input_ids"]

    def set_mode(self, mode: str) -> None:
        """Speculation mode of the following steps: static, adaptive or oracle."""
        if mode == "adaptive" and self.time_models is None:
            raise ValueError("adaptive mode needs speculative.adaptive.enabled=true (it starts the profile registry)")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        self.mode = mode

    def set_num_speculative_tokens(self, k: int) -> None:
        """Draft tokens per sequence from the next step on (0 turns speculation off)."""
        if not 0 <= k <= self.cfg.speculative.num_speculative_tokens:
            raise ValueError(f"k={k} must be in 0..speculative.num_speculative_tokens")
        self.scheduler.num_spec = k

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def idle(self) -> None:
        """Called by a server's loop when it has nothing to step: work that need not delay a
        step runs here (the time-model registry's calls; TimeModelLink.idle)."""
        if self.time_models is not None:
            self.time_models.idle()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        start, started = time.perf_counter(), time.time()
        gap_ms, self._step_end = (start - self._step_end) * 1e3 if self._step_end else 0.0, 0.0
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        plan, seqs = scheduled
        if self.time_models is not None:
            self.time_model_version = self.time_models.poll(plan.step)
        plan.time_model_version, plan.mode = self.time_model_version, self.mode
        plan.trace = plan.decode and self.tracer is not None
        t0 = time.perf_counter()
        try:
            results = self.workers.step(plan)
        except Exception as e:  # noqa: BLE001 - classified below
            if not _is_worker_failure(e) or self._failures >= MAX_RECOVERIES:
                raise
            self._recover(e)
            return []
        self._failures = 0
        wall_ms = (time.perf_counter() - t0) * 1e3
        self._check_digests(plan.step, results)
        lead = results[0]
        st = lead.stats
        self.stats.add(st, max(0.0, wall_ms - st.step_ms), plan.decode)
        if plan.decode and log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d seqs, %d draft steps, verified %d, accepted %s, validate %.2f ms "
                      "(predicted %.2f, model v%d)", plan.step, st.num_seqs, st.draft_steps,
                      sum(st.verified_per_position), st.accepted_per_position, st.validate_ms,
                      st.predicted_validate_ms, plan.time_model_version)
        by_id = {s.seq_id: s for s in seqs}
        updates = []
        for out in lead.outputs:
            seq = by_id[out.seq_id]
            seq.steps += 1
            seq.drafted += out.drafted
            seq.verified += out.verified
            seq.accepted += out.accepted
            self.stats.drafted += out.drafted
            self.stats.verified += out.verified
            self.stats.accepted += out.accepted
            updates.append(self._append(seq, out.new_tokens))
        if plan.decode:
            step_ms = (time.perf_counter() - start) * 1e3
            emitted = sum(len(u.new_token_ids) for u in updates)
            if self.time_models is not None and self._samples(st.draft_steps, st.catchup_tokens, st.draft_seqs):
                # what drafting cost includes deciding on it: the early stops and the keep decision. A rest with a
                # one-off in it is left out (0), a draft with one marked (StepStats.steady, draft_steady), and a
                # plain step still settling after drafting marked too (StepSample.settling)
                draft_ms = st.draft_ms + st.draft_control_ms
                other_ms = max(step_ms - draft_ms - st.validate_ms, 1e-3) if st.steady else 0.0
                self.time_models.record([StepSample(st.num_seqs, st.num_tokens, st.kv_tokens, st.validate_ms,
                                                    st.draft_steps, draft_ms, other_ms, emitted,
                                                    st.catchup_tokens, st.draft_seqs, int(not st.draft_steady),
                                                    int(0 < self._plain_run <= SETTLE_STEPS and self._drafted))])
            self.stats.decode_seq_ms += len(updates) * step_ms
            self.stats.decode_tokens += emitted
            if plan.trace:
                self.tracer.write(plan, st, step_ms, gap_ms, started)
        self._step_end = time.perf_counter()
        return updates

    def _samples(self, drafted: int, catchup: int = 0, rows: int = 0) -> bool:
        """Does the registry get this decode step (drafted: its draft steps; catchup: the tokens its
        `rows` drafting rows caught up on first)? Of a stretch that drafts, every DRAFT_SAMPLE_EVERY-th
        and every one past a steady step's catch-up (every one, until the registry has had SAMPLE_ALL);
        of a stretch that drafts nothing, the first PLAIN_RUN (a plain probe's stretch: probes.py) and
        every PLAIN_SAMPLE_EVERY-th."""
        self._drafted |= bool(drafted)
        if drafted:
            self._plain_run, self._draft_run = 0, self._draft_run + 1
            sampled = self._sampled < SAMPLE_ALL or catchup > STEADY_CATCHUP * rows or \
                (self._draft_run - 1) % DRAFT_SAMPLE_EVERY == 0
        else:
            self._plain_run, self._draft_run = self._plain_run + 1, 0
            sampled = self._plain_run <= PLAIN_RUN or (self._plain_run - 1) % PLAIN_SAMPLE_EVERY == 0
        self._sampled += sampled
        return sampled

    def _recover(self, error: Exception) -> None:
        """A rank died: rebuild the worker group and recompute every in-flight sequence
        from its prompt and emitted tokens. Nothing emitted is lost or emitted twice: the
        failed step's results were never applied, and recomputed tokens are not re-sent."""
        self._failures += 1
        self.stats.recoveries += 1
        log.warning("worker failure (%s: %s); rebuilding the worker group", type(error).__name__, error)
        try:
            self.workers.shutdown()
        except Exception:  # noqa: BLE001 - the old group is half dead; clean up what we can
            log.debug("old worker group shutdown failed", exc_info=True)
        self.workers = make_worker_group(self.cfg)
        self.scheduler.requeue_all()
        if self.time_models is not None:
            self.time_model_version = self.time_models.rebind(self.workers)

    def _check_digests(self, step: int, results: list[StepResult]) -> None:
        every = self.cfg.engine.digest_every
        if every and step % every == 0:
            digests = {r.digest for r in results}
            if len(digests) > 1:
                ranks = [r.rank for r in results if r.digest != results[0].digest]
                raise RankDivergenceError(f"step {step}: ranks {ranks} disagree with rank 0 on what was decided "
                                          f"and emitted")

    def _append(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        new = []
        for t in tokens:
            seq.output_ids.append(t)
            new.append(t)
            if not seq.params.ignore_eos and t in self.eos_ids:
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_tokens or seq.total_len >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        if self.decoder is not None:
            delta = seq.detok.extend(self.decoder, seq.output_ids, final=seq.finish_reason is not None)
            cut = find_stop(seq.detok.text, len(delta), seq.params.stop) if delta and seq.params.stop else -1
            if cut >= 0:
                seq.detok.text, seq.finish_reason = seq.detok.text[:cut], "stop"
        if seq.finish_reason:
            self.scheduler.finish(seq)
            del self.seqs[seq.seq_id]
        self.stats.emitted += len(new)
        tpot = 1e3 * (now - seq.first_token_time) / max(len(seq.output_ids) - 1, 1)
        return RequestOutput(request_id=seq.request_id, sample_index=seq.sample_index, prompt_ids=seq.prompt_ids,
                             token_ids=list(seq.output_ids), text=seq.text, finished=seq.status is Status.FINISHED,
                             finish_reason=seq.finish_reason, new_token_ids=new, seed=seq.seed, steps=seq.steps,
                             drafted=seq.drafted, verified=seq.verified, accepted=seq.accepted,
                             ttft_s=seq.first_token_time - seq.arrival, tpot_ms=tpot)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: list[str | list[int]], params: RequestParams) -> list[list[RequestOutput]]:
        """Run prompts to completion; returns, per prompt, its `n` finished outputs."""
        rids = [self.add_request(p, params) for p in prompts]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                if out.finished:
                    final[(out.request_id, out.sample_index)] = out
        return [[final[(rid, i)] for i in range(params.n)] for rid in rids]

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
        self.workers.shutdown()


MAX_RECOVERIES = 3  # consecutive rebuilds without a completed step before giving up


def _is_worker_failure(error: Exception) -> bool:
    """A rank (or its channel) is gone, as opposed to a bug that would fail again."""
    try:
        import ray.exceptions as rex
    except ImportError:  # no Ray: an in-process rank, whose errors are the driver's own
        return False

    dead = (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError, rex.NodeDiedError)
    channel = tuple(getattr(rex, n) for n in ("RayChannelError", "RayChannelTimeoutError") if hasattr(rex, n))
    return isinstance(error, dead + channel)


def load_tokenizer(path: str):
    from pathlib import Path

    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
