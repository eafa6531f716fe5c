# Temporary tuning sweep (deleted after use).
import itertools
import torch
import triton
import kernels.attention.triton_paged_attention as tpa
from benchmarks.bench_attention import CASES, run_case

decode_cases = [c for c in CASES if c.is_decode]
prefill_cases = [c for c in CASES if not c.is_decode]
orig_partition = tpa.decode_partition_len

def report(tag, cases):
    parts = []
    for c in cases:
        try:
            _, s, w = run_case("triton", c, 10)
            parts.append(f"{c.name}: {w / s / 1e12:7.2f}")
        except Exception as e:  # noqa: BLE001
            parts.append(f"{c.name}: ERR {type(e).__name__}")
    print(tag, " | ".join(parts), flush=True)

for mult in (2, 4, 8, 16):
    def part(nd, kvh, msl, sms, bn, mult=mult):
        return orig_partition(nd, kvh, msl, sms * mult // 2, bn)
    tpa.decode_partition_len = part
    for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        tpa._decode_config = lambda dtype, cfg=(bn, w, st): cfg
        report(f"decode mult={mult} bn={bn} w={w} st={st}", decode_cases)
