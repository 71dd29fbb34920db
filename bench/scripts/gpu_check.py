"""The engine's GPU check: parity, throughput and decode-step time on one CUDA device, in ~5 minutes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/scripts/gpu_check.py [--out DIR] [--budget-s 300]

Made for a bare lent H200 (docs/GPU.md says how to run it there with the device tool): it needs
only PyTorch, Triton and transformers (tokenizers, safetensors, tqdm) as that image has them, and
installs nothing. Steps, each guarded by the time budget (a step that would not fit is skipped,
one that fails is reported and the rest still run):

  0. the Triton GGUF block kernels (engine/models/triton_ggml.py) per type against the gguf package
     (skipped where the image has no gguf package)
  1. build seeded random models without downloads: the tiny presets and qwen25-05b-shape
     (Qwen2.5-0.5B's shape; its vocabulary of 151,936 is larger than its tokenizer's)
  2. greedy parity against transformers on CUDA, float32, exact tokens: every tiny preset and the
     0.5B shape, with decode CUDA graphs, and eagerly with 64-token chunked prefill
  3. bfloat16 tolerance: the engine's first-token logits against transformers float32, next to
     transformers' own bfloat16 error; ids past the tokenizer detokenize without error
  4. offline throughput on 256 mixed requests (prompt 128..1024, output 128..1024, seed 0,
     ignore_eos): the engine with and without CUDA graphs, transformers static batching
  5. decode step at batch 64 against its floor (weight bytes / measured device copy bandwidth)

Prints a short table last; writes gpu_check.json (every number) and gpu_check.log under --out
(default: $OUT, else ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.testing.make_model import ensure_model  # noqa: E402
from engine.text.detokenizer import IncrementalDetokenizer  # noqa: E402

log = logging.getLogger("gpu_check")

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
QWEN = "qwen25-05b-shape"


# ---- the report -----------------------------------------------------------------------------------


@dataclass
class Row:
    check: str
    result: str
    target: str = ""
    status: str = "INFO"  # PASS, FAIL, INFO, SKIP, ERROR


@dataclass
class Report:
    deadline: float
    rows: list[Row] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def add(self, check: str, result: str, target: str = "", ok: bool | None = None) -> None:
        status = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append(Row(check, result, target, status))
        log.info("%-44s %-32s %-14s %s", check, result, target, status)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, name: str, need_s: float, fn, *args):
        """Run one step unless less than need_s seconds are left; a failure becomes an ERROR row."""
        if self.left() < need_s:
            self.rows.append(Row(name, f"skipped: {self.left():.0f}s left, needs ~{need_s:.0f}s", "", "SKIP"))
            log.warning("skipping %s: %.0f s left", name, self.left())
            return None
        t0 = time.monotonic()
        log.info("---- %s (%.0f s left)", name, self.left())
        try:
            return fn(*args)
        except Exception as exc:  # report and go on: the other steps still say something
            self.rows.append(Row(name, f"{type(exc).__name__}: {str(exc)[:60]}", "", "ERROR"))
            self.details.setdefault("errors", {})[name] = traceback.format_exc()
            log.exception("%s failed", name)
            return None
        finally:
            self.details.setdefault("phase_s", {})[name] = round(time.monotonic() - t0, 1)
            free_memory()

    def table(self) -> str:
        w = [max(len(getattr(r, f)) for r in self.rows + [Row("check", "result", "target", "status")])
             for f in ("check", "result", "target", "status")]
        lines = [f"{'check':<{w[0]}}  {'result':<{w[1]}}  {'target':<{w[2]}}  status", "-" * (sum(w) + 6)]
        lines += [f"{r.check:<{w[0]}}  {r.result:<{w[1]}}  {r.target:<{w[2]}}  {r.status}" for r in self.rows]
        return "\n".join(lines)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 0. the machine -------------------------------------------------------------------------------


def machine(report: Report, device: str) -> None:
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # the engine then falls back to the reference backend
        info["triton"] = f"unavailable ({exc})"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    report.details["machine"] = info
    report.add("machine", f"{info.get('gpu', device)}, torch {info['torch']}, triton {info['triton']}")


def copy_bandwidth(report: Report, device: str) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if not device.startswith("cuda"):
        return None
    n = 1 << 30  # 2 GiB of bf16 per buffer: many times the L2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    bw = 2 * src.numel() * src.element_size() / statistics.median(times)
    report.details["copy_bandwidth_bytes_s"] = bw
    report.add("device copy bandwidth (read + write)", f"{bw / 1e12:.2f} TB/s")
    return bw


# ---- 1. models ------------------------------------------------------------------------------------


def ggml_kernels(report: Report, device: str) -> None:
    """The Triton GGUF kernels (engine/models/triton_ggml.py) compiled on this GPU, per type against
    gguf.quants.dequantize on random blocks: the dequantize bit-exact (float32, and bf16 rounded once),
    the GEMV within the float32 bound of any summation order (tests/engine/test_triton_ggml.py's, run
    there under the interpreter), at 1, 3 and 9 rows of x and 300 weight rows."""
    try:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        from engine.testing.make_gguf import random_blocks
    except ImportError as exc:  # the image lacks the gguf package: say so, check nothing
        report.rows.append(Row("ggml triton kernels", f"skipped: {exc}"[:60], "", "SKIP"))
        return
    from engine.models import triton_ggml as TG

    bad: list[str] = []
    n = 300
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        k = 1024
        host = random_blocks(qtype, n, k, int(qtype))
        want = torch.from_numpy(dequantize(host, qtype))  # [n, k] float32
        blocks = torch.from_numpy(host).to(device)
        got = TG.ggml_dequantize_triton(blocks, int(qtype), n, k, torch.float32).cpu()
        got16 = TG.ggml_dequantize_triton(blocks, int(qtype), n, k, torch.bfloat16).cpu()
        ok = torch.equal(got.view(torch.int32), want.view(torch.int32)) and \
            torch.equal(got16.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))  # fmt: skip
        for rows in (1, 3, 9):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            y = TG.ggml_gemv_triton(x.to(device), blocks, int(qtype), n, k).cpu().double()
            ref = x.double() @ want.double().t()
            bound = 2 * k * 2**-24 * (x.double().abs() @ want.double().abs().t()) + 1e-30
            ok = ok and bool(((y - ref).abs() <= bound).all())
        if not ok:
            bad.append(qtype.name)
    report.add("ggml triton kernels (8 types)", f"wrong: {', '.join(bad)}" if bad else "all exact / in bound",
               "every type", not bad)


def build_models(report: Report, cache: Path, presets) -> dict[str, Path]:
    paths = {}
    for p in presets:
        t0 = time.monotonic()
        paths[p] = ensure_model(p, cache)
        report.details.setdefault("build_s", {})[p] = round(time.monotonic() - t0, 1)
    report.add("models built", f"{len(paths)} in {sum(report.details['build_s'].values()):.0f}s")
    return paths


# ---- 2. float32 parity ----------------------------------------------------------------------------


def parity_case(vocab: int, n: int, max_prompt: int, max_new: int, seed: int):
    """n prompts of 1..max_prompt tokens (half share a 40-token prefix), max_tokens 1..max_new."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(40)]
    prompts, new = [], []
    for i in range(n):
        body = [rng.randrange(10, vocab) for _ in range(rng.randint(1, max_prompt))]
        prompts.append((prefix + body)[: max(len(body), 41)] if i % 2 else body)
        new.append(rng.randint(1, max_new))
    prompts[0], new[0] = prompts[0][:1], max_new  # the extremes
    return prompts, new


def hf_greedy(model, prompts, new, device) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p, m in zip(prompts, new, strict=True):
            ids = torch.tensor([p], device=device)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
            out.append(seq[0, len(p):].tolist())
    return out


def tie_margin(model, prompt, ref, got, device) -> float | None:
    """At the first differing position: transformers' top-1 minus top-2 logit (a near tie is tiny)."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if k is None:
        return None
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:k]], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def engine_config(path: Path, device: str, dtype: str, **kw) -> EngineConfig:
    base = dict(model=str(path), dtype=dtype, device=device, show_progress=False, max_num_seqs=64)
    base.update(kw)
    return EngineConfig(**base)


def fp32_parity(report: Report, name: str, path: Path, device: str, n: int, max_prompt: int, max_new: int,
                kv_blocks: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = min(AutoConfig.from_pretrained(str(path)).vocab_size, 49152)  # ids the tokenizer knows
    prompts, new = parity_case(vocab, n, max_prompt, max_new, seed=zlib.crc32(name.encode()))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    t0 = time.monotonic()
    ref = hf_greedy(hf, prompts, new, device)
    report.details.setdefault("hf_reference_s", {})[name] = round(time.monotonic() - t0, 1)
    modes = {"": {}, ", chunked 64": dict(enforce_eager=True, max_num_batched_tokens=64)}
    for chunk, kw in modes.items():
        engine = Engine(engine_config(path, device, "float32", num_kv_blocks=kv_blocks, **kw))
        mode = ("graphs" if engine.runner.graphs is not None else "eager") + chunk
        res = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in new])
        got = [r.token_ids for r in res]
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
        margins = [tie_margin(hf, prompts[i], ref[i], got[i], device) for i in bad[:4]]
        errors = sum(1 for r in res if r.finish_reason is not None and r.finish_reason.value == "error")
        report.details.setdefault("parity_fp32", {})[f"{name} / {mode}"] = {
            "prompts": n, "mismatches": bad, "tie_margins": margins, "errors": errors,
            "attention": engine.runner.backend.name, "graphs": engine.runner.graphs is not None,
        }
        label = f"fp32 parity {name} ({mode}, {engine.runner.backend.name})"
        extra = f", margins {','.join(f'{m:.1e}' for m in margins if m is not None)}" if bad else ""
        report.add(label, f"{n - len(bad)}/{n} exact{extra}", "exact", not bad and not errors)
        del engine
        free_memory()


# ---- 3. bfloat16 tolerance ------------------------------------------------------------------------


def first_logits(engine: Engine) -> dict[str, torch.Tensor]:
    """Records the logits each request is first sampled from (its prompt's last position)."""
    seen: dict[str, torch.Tensor] = {}
    sampler = engine.runner.sampler
    sample = sampler.sample

    def spy(logits, reqs):
        for i, r in enumerate(reqs):
            if r.num_output_tokens == 0 and r.request_id not in seen:
                seen[r.request_id] = logits[i].float().cpu()
        return sample(logits, reqs)

    sampler.sample = spy
    return seen


def bf16_tolerance(report: Report, path: Path, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    vocab = min(AutoConfig.from_pretrained(str(path)).vocab_size, 49152)  # ids the tokenizer knows
    prompts, new = parity_case(vocab, 8, 300, 16, seed=16)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        ref32 = [hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
        hf = hf.to(torch.bfloat16)  # the checkpoint is bf16: the same weights
        ref16 = [hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
    hf_tokens = hf_greedy(hf, prompts, new, device)
    del hf
    free_memory()
    engine = Engine(engine_config(path, device, "bfloat16", num_kv_blocks=2048))
    seen = first_logits(engine)
    res = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in new])
    got = [seen[r.request_id] for r in res]

    def rel(a, b):
        return float(torch.stack(a).sub(torch.stack(b)).norm() / torch.stack(b).norm())

    err_engine, err_hf = rel(got, ref32), rel(ref16, ref32)
    same_first = sum(r.token_ids[:1] == h[:1] for r, h in zip(res, hf_tokens, strict=True))
    same_all = sum(r.token_ids == h for r, h in zip(res, hf_tokens, strict=True))
    report.details["bf16"] = {"logits_rel_err_engine": err_engine, "logits_rel_err_hf_bf16": err_hf,
                              "first_token_agree": same_first, "sequences_agree": same_all, "n": len(prompts)}
    report.add("bf16 logits rel. err vs fp32 (engine / hf)", f"{err_engine:.2e} / {err_hf:.2e}",
               "<= 2x hf bf16", err_engine <= max(2 * err_hf, 1e-3))
    report.add("bf16 greedy agree with hf bf16 (first / all)", f"{same_first}/{len(res)} / {same_all}/{len(res)}")
    detokenize_past_tokenizer(report, engine, AutoTokenizer.from_pretrained(str(path)), res)
    del engine


def detokenize_past_tokenizer(report: Report, engine: Engine, tok, results) -> None:
    """ids >= len(tokenizer) (the embedding has more rows) decode to text without raising."""
    n_tok, vocab = len(tok), engine.vocab_size
    ids = [n_tok, n_tok + 1, (n_tok + vocab) // 2, vocab - 1]
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]) for i in ids) + detok.add([], final=True)
    sampled_past = sum(t >= n_tok for r in results for t in r.token_ids)
    report.details["detokenize_past_tokenizer"] = {"tokenizer_len": n_tok, "vocab": vocab, "ids": ids,
                                                   "text": text, "sampled_ids_past_tokenizer": sampled_past}
    report.add("ids past the tokenizer detokenize", f"ok ({sampled_past} sampled past {n_tok})", "no error", True)


# ---- 4. throughput --------------------------------------------------------------------------------


def workload(path: Path, n: int, lo: int, hi: int):
    from transformers import AutoTokenizer

    from bench.lib.workloads import mixed_workload, ordinary_token_ids

    tok = AutoTokenizer.from_pretrained(str(path))
    return mixed_workload(ordinary_token_ids(tok), n, (lo, hi), (lo, hi), seed=0)


def engine_throughput(report: Report, label: str, path: Path, device: str, wl, eager: bool, args):
    cfg = engine_config(path, device, args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=eager)
    t0 = time.monotonic()
    engine = Engine(cfg)
    startup = time.monotonic() - t0
    warm = [list(r.prompt_token_ids[:16]) for r in wl.requests[:4]]
    engine.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    prompts = [list(r.prompt_token_ids) for r in wl.requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in wl.requests]
    sync(device)
    t0 = time.perf_counter()
    res = engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - t0
    lengths_ok = [len(r.token_ids) for r in res] == [r.output_len for r in wl.requests]
    st = engine.stats()
    d = {"wall_s": wall, "output_tok_s": wl.output_tokens / wall, "total_tok_s": (wl.output_tokens + wl.prompt_tokens) / wall,
         "startup_s": startup, "kv_blocks": st.kv_blocks_total, "kv_tokens": st.kv_blocks_total * cfg.block_size,
         "steps": st.steps, "preemptions": st.preemptions, "lengths_ok": lengths_ok,
         "attention": engine.runner.backend.name, "graphs": engine.runner.graphs is not None,
         "device_memory": engine.device_memory()}
    d["decode_step_b64"] = decode_step(engine, args.max_len // 2)
    report.details.setdefault("throughput", {})[label] = d
    report.add(f"throughput {label}", f"{d['output_tok_s']:,.0f} out tok/s ({wall:.1f}s)", "", None if lengths_ok else False)
    report.add(f"  KV cache ({label})", f"{d['kv_blocks']:,} blocks = {d['kv_tokens']:,} tokens, "
                                        f"graphs {'on' if d['graphs'] else 'off'}")
    return d


def decode_step(engine: Engine, prompt_len: int) -> dict:
    """Median engine step with 64 running decodes (context ~prompt_len), and the graph replay plus
    logits alone (CUDA events)."""
    rng = random.Random(1)
    for i in range(64):
        engine.add_request(f"b64-{i}", prompt_token_ids=[rng.randrange(10, 2000) for _ in range(prompt_len)],
                           params=SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(200):  # prefill every prompt first
        engine.step()
        if engine.stats().last_step_decode_tokens == 64 and not engine.stats().last_step_prefill_tokens:
            break
    times = []
    for _ in range(24):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {"engine_step_ms": statistics.median(times) * 1e3, "batch": engine.stats().last_step_decode_tokens}
    graphs, model = engine.runner.graphs, engine.runner.model
    if graphs is not None and 64 in graphs.buckets:  # replays the last step: same K/V to the same slots
        with torch.inference_mode():
            for _ in range(3):
                model.compute_logits(graphs.replay(64))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                model.compute_logits(graphs.replay(64))
            b.record()
            b.synchronize()
        out["graph_forward_ms"] = a.elapsed_time(b) / 50
    while engine.has_unfinished():
        engine.step()
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def hf_static(report: Report, path: Path, device: str, wl, args) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).to(device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    reqs = list(wl.requests)
    size = args.hf_batch_size
    with torch.inference_mode():
        _hf_batch(hf, reqs[:2], pad, device, cap=8)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for s in range(0, len(reqs), size):
            _hf_batch(hf, reqs[s : s + size], pad, device)
        sync(device)
    wall = time.perf_counter() - t0
    d = {"wall_s": wall, "output_tok_s": wl.output_tokens / wall, "batch_size": size}
    report.details.setdefault("throughput", {})["transformers static"] = d
    report.add(f"throughput transformers static (batch {size})", f"{d['output_tok_s']:,.0f} out tok/s ({wall:.1f}s)")
    return d


def _hf_batch(hf, batch, pad: int, device: str, cap: int | None = None) -> None:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    n = max(r.output_len for r in batch) if cap is None else cap  # a static batch runs to its longest
    hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=n,
                min_new_tokens=n, pad_token_id=pad)


def summarize(report: Report, bw: float | None) -> None:
    tp = report.details.get("throughput", {})
    graphs, eager, hf = tp.get("engine + graphs"), tp.get("engine eager"), tp.get("transformers static")
    if graphs and hf:
        x = graphs["output_tok_s"] / hf["output_tok_s"]
        report.add("engine + graphs vs transformers static", f"{x:.1f}x", ">= 5x", x >= 5)
    if graphs and eager:
        report.add("CUDA graphs speed-up (engine)", f"{graphs['output_tok_s'] / eager['output_tok_s']:.2f}x")
    for label, d in (("graphs", graphs), ("eager", eager)):
        step = d and d.get("decode_step_b64")
        if not step:
            continue
        floor_ms = step["weight_bytes"] / bw * 1e3 if bw else None
        fwd = step.get("graph_forward_ms")
        if fwd is not None and floor_ms:
            report.add("decode b64 forward (graph replay) / floor", f"{fwd:.3f} / {floor_ms:.3f} ms = {fwd / floor_ms:.1f}x",
                       "<= 2x", fwd <= 2 * floor_ms)
        ratio = f" = {step['engine_step_ms'] / floor_ms:.1f}x floor" if floor_ms else ""
        report.add(f"decode b64 engine step ({label})", f"{step['engine_step_ms']:.2f} ms{ratio}")


# ---- main -----------------------------------------------------------------------------------------


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    ap.add_argument("--models", type=Path, default=Path("/tmp/tokenmill-models"), help="model cache folder")
    ap.add_argument("--budget-s", type=float, default=300, help="skip steps that would end past this")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="throughput dtype")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--parity-prompts", type=int, default=16)
    ap.add_argument("--big", default=QWEN, help="preset for the 0.5B checks (dry runs: a tiny one)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "gpu_check.log")])
    report = Report(deadline=time.monotonic() + args.budget_s)
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: nothing to check here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    report.phase("machine", 0, machine, report, dev)
    bw = report.phase("copy bandwidth", 5, copy_bandwidth, report, dev)
    report.phase("ggml triton kernels", 10, ggml_kernels, report, dev)
    paths = report.phase("build models", 20, build_models, report, args.models, (*TINY, args.big)) or {}
    for p in TINY:
        if p in paths:
            report.phase(f"fp32 parity {p}", 15, fp32_parity, report, p, paths[p], dev, args.parity_prompts, 300, 32, 4096)
    if args.big in paths:
        big = paths[args.big]
        report.phase(f"fp32 parity {args.big}", 30, fp32_parity, report, args.big, big, dev, 8, 200, 24, 1024)
        report.phase("bf16 tolerance", 25, bf16_tolerance, report, big, dev)
        wl = workload(big, args.requests, args.min_len, args.max_len)
        report.details["workload"] = wl.describe()
        # the two runs the 5x target compares first, then the eager engine
        report.phase("throughput engine + graphs", 30, engine_throughput, report, "engine + graphs", big, dev, wl,
                     False, args)
        report.phase("throughput transformers static", 40, hf_static, report, big, dev, wl, args)
        report.phase("throughput engine eager", 30, engine_throughput, report, "engine eager", big, dev, wl, True, args)
        summarize(report, bw)
    (args.out / "gpu_check.json").write_text(json.dumps(
        {"rows": [vars(r) for r in report.rows], **report.details}, indent=2, default=str))
    print("\n" + report.table(), flush=True)
    return 0 if all(r.status in ("PASS", "INFO") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
