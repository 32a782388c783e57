"""The bench's figures as one JSON-ready dict, and the readable tables rendered from it."""

from __future__ import annotations

import math
import statistics
from typing import Any

from rosechat.bench.decode import DecodeReport
from rosechat.bench.roofline import DecodeRoofline, Machine, ModelCost, decode_roofline
from rosechat.bench.sampling import GREEDY
from rosechat.bench.systems import CONTINUOUS, GENERATE, LLAMA_CPP, ROSECHAT, SystemResult
from rosechat.bench.workloads import Workload

MIB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median_range(ratios: list[float]) -> str:
    """Ratios paired within rounds as '1.30x (1.25-1.41)': their median and range ('' for none)."""
    if not ratios:
        return ""
    text = f"{statistics.median(ratios):.2f}x"
    return text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def label(res: SystemResult) -> str:
    """The system, and the sampling setting where not greedy: one row of the tables."""
    return res.name if res.sampling == GREEDY else f"{res.name} [{res.sampling}]"


def system_figures(res: SystemResult) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": res.name,
        "sampling": res.sampling,
        "label": label(res),
        "output_tok_s": res.output_tokens / res.wall_s,
        "total_tok_s": (res.prompt_tokens + res.output_tokens) / res.wall_s,
        "ttft_p50_s": percentile(res.ttfts, 0.5),
        "ttft_p95_s": percentile(res.ttfts, 0.95),
        "prefill_tokens": res.prefill_tokens,
        "peak_kv_bytes": res.peak_kv_bytes,
        "peak_kv_bytes_without_sharing": res.peak_kv_bytes_unshared,
        "outputs_match": res.outputs_match,
        "wall_s": res.wall_s,
        "prompt_tokens": res.prompt_tokens,
        "output_tokens": res.output_tokens,
    }
    if res.kv_block_bytes:
        d["peak_kv_blocks"] = res.peak_kv_bytes // res.kv_block_bytes
        d["peak_kv_blocks_without_sharing"] = (res.peak_kv_bytes_unshared or 0) // res.kv_block_bytes
    if res.mismatch:
        d["mismatch"] = res.mismatch
    return d


def _add_ratios(systems: list[dict[str, Any]]) -> None:
    """Each system against transformers' generate() (greedy), llama.cpp with the same setting and its own
    greedy run."""
    def find(name: str, sampling: str) -> dict[str, Any] | None:
        return next((s for s in systems if s["name"] == name and s["sampling"] == sampling), None)

    base = find(GENERATE, GREEDY)
    for s in systems:
        if base is not None:
            s["vs_generate"] = {
                k: _ratio(s[k], base[k])
                for k in ("output_tok_s", "total_tok_s", "ttft_p50_s", "prefill_tokens", "peak_kv_bytes")
            }
        llama, greedy = find(LLAMA_CPP, s["sampling"]), find(s["name"], GREEDY)
        if llama is not None and s is not llama:
            s["output_vs_llama_cpp"] = _ratio(s["output_tok_s"], llama["output_tok_s"])
        if greedy is not None and s is not greedy:
            s["output_vs_own_greedy"] = _ratio(s["output_tok_s"], greedy["output_tok_s"])


def _targets(systems: dict[str, dict[str, Any]], sampled: list[dict[str, Any]],
             decode: DecodeReport | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher_is_better: bool) -> None:
        if value is not None:
            met = value >= limit if higher_is_better else value <= limit
            out.append({"name": name, "value": value, "op": ">=" if higher_is_better else "<=", "limit": limit,
                        "met": met})

    rc = systems.get(ROSECHAT)
    if rc is not None:
        gen, cb = systems.get(GENERATE), systems.get(CONTINUOUS)
        add("rosechat output tok/s / generate()", _ratio(rc["output_tok_s"], gen and gen["output_tok_s"]), 3.0, True)
        add("rosechat output tok/s / continuous batching",
            _ratio(rc["output_tok_s"], cb and cb["output_tok_s"]), 1.5, True)
        add("rosechat peak KV blocks / without sharing",
            _ratio(rc.get("peak_kv_blocks"), rc.get("peak_kv_blocks_without_sharing")), 0.25, False)
    for s in sampled:  # issue 26: every setting at the speed of greedy
        add(f"rosechat [{s['sampling']}] output tok/s / rosechat greedy", s.get("output_vs_own_greedy"), 0.95, True)
    for f in decode.figures if decode else []:
        add(f"decode step / model math at {f.num_seqs} seqs", f.ratio, 1.5, False)
    big = max(decode.figures, key=lambda f: f.num_seqs) if decode and decode.figures else None
    if big is not None:
        # what the target counts; the table's "host ms" also holds sampling and output handling
        add(f"scheduler + block manager + input preparation ms/step at {big.num_seqs} seqs",
            big.schedule_ms + big.prepare_ms, 1.0, False)
    return out


def build_report(
    *,
    workload: Workload | None,
    header: dict[str, Any],
    results: list[SystemResult],
    machine: Machine,
    cost: ModelCost,
    decode: DecodeReport | None,
) -> dict[str, Any]:
    systems = [system_figures(r) for r in results]
    _add_ratios(systems)
    by_name = {s["name"]: s for s in systems if s["sampling"] == GREEDY}
    sampled = [s for s in systems if s["name"] == ROSECHAT and s["sampling"] != GREEDY]
    rc = next((r for r in results if r.name == ROSECHAT and r.sampling == GREEDY), None)
    workload_roofline = None
    if rc is not None:
        steps = [(s.num_seqs, s.context_tokens, s.total_s) for s in rc.decode_steps]
        workload_roofline = decode_roofline(machine, cost, steps)
    roofline: dict[str, Any] = {
        "matmul_gflops": machine.matmul_gflops,
        "mem_bw_gbs": machine.mem_bw_gbs,
        "model": {
            "matmul_params": cost.matmul_params,
            "weight_bytes": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token,
            "flops_per_token": 2 * cost.matmul_params,
        },
        "rosechat_decode": workload_roofline.as_dict() if workload_roofline else None,
    }
    report: dict[str, Any] = {
        "workload": workload.name if workload else "decode-overhead",
        "model": header["model"],
        **{k: v for k, v in header.items() if k != "model"},
        "systems": systems,
        "roofline": roofline,
    }
    if workload is not None:
        report["workload_params"] = workload.params
        report["workload_summary"] = workload.summary
        if workload.num_rounds > 1:
            report["turns"] = [
                {
                    "turn": k + 1,
                    "new_tokens": sum(len(t.new_tokens) for _, t in workload.round(k)),
                    "prompt_tokens": results[0].round_prompt[k] if results else None,
                    "prefill_tokens": {label(r): r.round_prefill[k] for r in results},
                }
                for k in range(workload.num_rounds)
            ]
    if decode is not None:
        report["decode_overhead"] = {
            "prefill_tok_s": decode.prefill_tok_s,
            "hash_us_per_block": decode.hash_us_per_block,
            "block_size": decode.block_size,
            "batches": [f.as_dict() for f in decode.figures],
        }
        roofline["decode_overhead"] = {
            str(f.num_seqs): _as_dict(decode_roofline(machine, cost, f.steps)) for f in decode.figures
        }
        if decode.profile is not None:
            report["profile"] = {
                "trace": decode.trace_path,
                "top_self_cpu": [vars(row) for row in decode.profile],
            }
    report["targets"] = _targets(by_name, sampled, decode)
    return report


def _as_dict(r: DecodeRoofline | None) -> dict[str, Any] | None:
    return r.as_dict() if r else None


# ---------------------------------------------------------------------------------------------- rendering
def _fmt(v: Any, spec: str = ",.1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [line(head), *[line(r) for r in rows]]


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    h = report
    out.append(
        f"rosechat bench {h['workload']}: {h['model']} | {h['dtype']} | {h['threads']} threads | {h['device']} | "
        f"torch {h['torch']} | transformers {h['transformers']}"
    )
    if "cpu" in h:  # what ran: the machine, our kernels or torch's, and why this dtype
        out.append(f"{h['cpu']} | quantization {h['quantization']} | {h['kernels']} | {h['reason']}")
    out.append(f"load average {h['load_before']} before, {h['load_after']} after | bench wall {h['wall_s']:.0f} s"
               f" | source {h.get('source') or '?'}")
    if "workload_summary" in h:
        out.append(f"workload: {h['workload_summary']}")
    if h["systems"]:
        out += [""] + _systems_table(h["systems"])
        bad = [s for s in h["systems"] if not s["outputs_match"]]
        for s in bad:
            out.append(f"  ! {s['label']}: outputs do not match transformers: {s.get('mismatch', '?')}")
    if "turns" in h:
        out += ["", "prefill tokens per turn (new = the turn's user message; a continued conversation also "
                "computes the previous reply's last token, sampled but never fed back)"]
        names = [s["label"] for s in h["systems"]]
        rows = [[str(t["turn"]), _fmt(t["new_tokens"], ","), _fmt(t["prompt_tokens"], ",")]
                + [_fmt(t["prefill_tokens"][n], ",") for n in names] for t in h["turns"]]
        out += _table(rows, ["turn", "new", "prompt", *names])
    if "decode_overhead" in h:
        out += ["", *_decode_table(h)]
    out += ["", *_roofline_lines(h)]
    if "profile" in h:
        p = h["profile"]
        out += ["", f"profile ({p['trace']}): top ops by self CPU time, per decode step"]
        rows = [[r["name"], _fmt(r["self_cpu_ms_per_step"], ".2f"), _fmt(r["calls_per_step"], ".0f")]
                for r in p["top_self_cpu"]]
        out += _table(rows, ["op", "self ms", "calls"])
    if h["targets"]:
        out += ["", "targets (measured, not enforced):"]
        for t in h["targets"]:
            mark = "x" if t["met"] else " "
            out.append(f"  [{mark}] {t['name']}: {t['value']:.2f} (target {t['op']} {t['limit']:g})")
    return "\n".join(out)


def _systems_table(systems: list[dict[str, Any]]) -> list[str]:
    rows = []
    for s in systems:
        vs = s.get("vs_generate", {})
        kv = _fmt(s["peak_kv_bytes"] / MIB)
        if s.get("peak_kv_blocks") is not None:
            kv += f" ({s['peak_kv_blocks']} blk)"
        unshared = s["peak_kv_bytes_without_sharing"]
        kv_unshared = "-" if unshared is None else _fmt(unshared / MIB)
        if s.get("peak_kv_blocks_without_sharing") is not None:
            kv_unshared += f" ({s['peak_kv_blocks_without_sharing']} blk)"
        rows.append([
            s["label"],
            _fmt(s["output_tok_s"]),
            _fmt(s["total_tok_s"]),
            _fmt(s["ttft_p50_s"], ".2f"),
            _fmt(s["ttft_p95_s"], ".2f"),
            _fmt(s["prefill_tokens"], ","),
            kv,
            kv_unshared,
            _fmt(vs.get("output_tok_s"), ".2f") + "x" if vs.get("output_tok_s") else "-",
            _fmt(vs.get("prefill_tokens"), ".2f") + "x" if vs.get("prefill_tokens") else "-",
            _fmt(s.get("output_vs_llama_cpp"), ".2f") + "x" if s.get("output_vs_llama_cpp") else "-",
            _fmt(s.get("output_vs_own_greedy"), ".2f") + "x" if s.get("output_vs_own_greedy") else "-",
            _fmt(s["wall_s"]),
            "yes" if s["outputs_match"] else "NO",
        ])
    head = ["system", "out tok/s", "total tok/s", "TTFT p50 s", "TTFT p95 s", "prefill tok",
            "peak KV MiB", "KV w/o sharing", "out vs gen", "prefill vs gen", "out vs llama.cpp", "out vs greedy",
            "wall s", "match"]
    return _table(rows, head)


def _decode_table(h: dict[str, Any]) -> list[str]:
    d = h["decode_overhead"]
    roof = h["roofline"].get("decode_overhead", {})
    rows = []
    for f in d["batches"]:
        r = roof.get(str(f["num_seqs"])) or {}
        rows.append([
            str(f["num_seqs"]), _fmt(f["context"], ".0f"), _fmt(f["step_ms"], ".2f"), _fmt(f["model_ms"], ".2f"),
            _fmt(f["step_over_model"], ".2f") + "x", _fmt(f["host_ms"], ".2f"), _fmt(f["schedule_ms"], ".2f"),
            _fmt(f["prepare_ms"], ".2f"), _fmt(f["sample_ms"], ".2f"), _fmt(f["other_ms"], ".2f"),
            _fmt(r.get("limit_ms"), ".2f"), _fmt(r.get("fraction", 0) * 100, ".0f") + "%",
        ])
    head = ["seqs", "ctx/seq", "step ms", "model ms", "step/model", "host ms", "schedule", "prepare", "sample",
            "other", "roofline ms", "of roofline"]
    big = max(d["batches"], key=lambda f: f["num_seqs"])["num_seqs"] if d["batches"] else 0
    hashing = (f"prefix-cache hashing (blake2b chain): {d['hash_us_per_block']:.1f} us per full block, so "
               f"{big / d['block_size'] * d['hash_us_per_block']:.1f} us per decode step at {big} seqs "
               f"(one block per sequence every {d['block_size']} tokens)")
    return [f"rosechat decode step (median; prefill while filling the sequences: {d['prefill_tok_s']:.0f} tok/s)",
            *_table(rows, head), hashing]


def _roofline_lines(h: dict[str, Any]) -> list[str]:
    r = h["roofline"]
    m = r["model"]
    lines = [
        f"roofline: this machine {r['matmul_gflops']:.1f} GFLOP/s (matmul), {r['mem_bw_gbs']:.1f} GB/s (copy); "
        f"model {m['matmul_params'] / 1e6:.1f}M matmul params = {m['flops_per_token'] / 1e9:.2f} GFLOP/token, "
        f"{m['weight_bytes'] / 1e6:.0f} MB weights read per decode step, {m['kv_bytes_per_token'] / 1024:.0f} KiB "
        f"KV per token"
    ]
    d = r.get("rosechat_decode")
    if d:
        lines.append(
            f"  rosechat decode steps in this workload: batch {d['batch']:.1f}, {d['context_tokens']:,.0f} context "
            f"tokens: {d['flops'] / 1e9:.2f} GFLOP and {d['bytes'] / 1e6:.0f} MB per step -> at least "
            f"{d['limit_ms']:.1f} ms ({d['bound']}-bound); measured {d['measured_ms']:.1f} ms = "
            f"{d['fraction'] * 100:.0f}% of the roofline"
        )
    return lines
