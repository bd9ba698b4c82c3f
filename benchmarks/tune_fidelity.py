"""Does tuning's one-node timing predict a fused node's time in the model?

Tuning (`onnxfuse.tune`) decides every fused node, and every candidate configuration, by the
node's time alone: its one-node model in a bundle (`onnxfuse.bundle`), inputs made once and
read from memory. In the model the same kernel reads what the kernel before it just wrote.
`compare.py --suite --profile` keeps both: the tuning record (`tune.nodes`: each node's
one-node `fused_ms` and the configuration chosen) and onnxfuse's model under ORT's profiler
(`profile.onnxfuse.top`: CUPTI kernel time per node). This reads suite results (one or more
`.json` / `.json.gz`, no GPU) and prints, per model and per (kind, configuration) fused
there, the median one-node time, the median time in the model and their ratio.

On the H200 (twenty-second session, BERT-base b8 fp16): the row kernel tuning chose (one warp
a row) took 2.56 us alone and 3.15 in the model, where the heuristic's tile took 3.6 alone and
3.1 in the model: a choice made on the one-node times that the model did not keep.

    python benchmarks/tune_fidelity.py benchmarks/results/suite_tfm_session22_a.json.gz --json fidelity.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnxfuse.outputs import write_text  # noqa: E402

# decisions that leave no fused node in the model
NOT_FUSED = ("original", "not measured", "left to ONNX Runtime")


def load(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def fidelity(result: dict) -> list[dict]:
    """One row per (model, kind, configuration chosen): nodes, median one-node and in-model
    µs, their ratio (in the model / alone). Cases without a tuning record or a profile of the
    onnxfuse model are skipped."""
    rows = []
    for case in result.get("cases", []):
        nodes = (case.get("tune") or {}).get("nodes") or []
        prof = ((case.get("profile") or {}).get("onnxfuse") or {}).get("top") or []
        in_model = {p["node"]: p["us"] for p in prof}
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for d in nodes:
            if d.get("fused_ms") is None or d["chosen"].startswith(NOT_FUSED) or d["node"] not in in_model:
                continue
            label = d["chosen"] if d.get("candidates") else "not searched"
            groups.setdefault((d["kind"], label), []).append((d["fused_ms"] * 1e3, in_model[d["node"]]))
        for (kind, label), pairs in sorted(groups.items()):
            alone = statistics.median(p[0] for p in pairs)
            model = statistics.median(p[1] for p in pairs)
            rows.append({"model": case["model"], "kind": kind, "config": label, "nodes": len(pairs),
                         "alone_us": round(alone, 3), "in_model_us": round(model, 3),
                         "ratio": round(model / alone, 3) if alone > 0 else None})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | kind | configuration | nodes | alone (µs) | in the model (µs) | in the model / alone |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"| {r['model']} | {r['kind']} | {r['config']} | {r['nodes']} | {r['alone_us']:.2f} | "
                   f"{r['in_model_us']:.2f} | {ratio} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="compare.py --suite --profile JSON (.json or .json.gz)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for path in args.results:
        try:
            rows += fidelity(load(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            ap.error(f"{path}: not a readable compare.py result ({e})")
    if not rows:
        ap.error("no case has both a tuning record and a profile of the onnxfuse model (compare.py --profile)")
    print(table(rows), end="")
    if args.json:
        write_text(args.json, json.dumps({"benchmark": "tune_fidelity", "sources": [str(p) for p in args.results],
                                          "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
