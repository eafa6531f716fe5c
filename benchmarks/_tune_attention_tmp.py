# Temporary: decode kernel alone (no cache write) under CUDA graph replay (deleted after use).
import torch
from benchmarks.bench_attention import CASES, make_meta, time_graph_s
from kernels.attention.triton_backend import paged_decode_attention

dev = torch.device("cuda")
for case in [c for c in CASES if c.is_decode]:
    meta = make_meta(case, 16, dev)
    nb = int(meta.block_tables.max()) + 1
    kc = torch.randn(nb, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    vc = torch.randn_like(kc)
    q = torch.randn(meta.num_tokens, 32, 128, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    def f():
        paged_decode_attention(out, q, kc, vc, meta.block_tables, meta.seq_lens, nd, max(meta.seq_lens_cpu), 128**-0.5)
    f(); torch.cuda.synchronize()
    t = time_graph_s(f, 50)
    b = sum(meta.seq_lens_cpu) * 8 * 128 * 2 * 2
    print(f"kernel only {case.name}: {t*1e6:.1f} us {b/t/1e12:.2f} TB/s", flush=True)
