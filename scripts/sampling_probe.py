"""Speculative TPOT with the LFM2.5 model card's sampling settings (temperature 0.1, top_k 50, top_p 0.1,
repetition_penalty 1.05) against greedy, and against target-only (issue 34's figure; GPU).

    python scripts/sampling_probe.py          # LFM2.5-1.2B preset + draft, imposed acceptance 0.8
"""
import json, statistics, time
import torch
from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset

res = {}
torch.manual_seed(0)
prompt = torch.randint(100, 60000, (128,)).tolist()
for kind in ("speculative", "target-only"):
    kw = {}
    if kind == "speculative":
        kw["imposed_acceptance"] = [0.8] * draft_preset(DEFAULT_DRAFT["lfm2.5-1.2b"]).block_size
    e = Engine.from_preset("lfm2.5-1.2b", **({} if kind == "speculative" else {"draft": None}), max_batch=8,
                           batch_sizes=[1, 8], max_seq_len=1024, **kw)
    t0 = time.time(); e.warmup(progress=False); print(kind, "warmup", round(time.time() - t0, 1), flush=True)
    for batch in (1, 8) if kind == "speculative" else (1,):
        for name in ("greedy", "card"):
            def params(i):
                if name == "greedy":
                    return SamplingParams(max_new_tokens=256, ignore_eos=True)
                return SamplingParams(max_new_tokens=256, ignore_eos=True, temperature=0.1, top_k=50, top_p=0.1,
                                      repetition_penalty=1.05, seed=i)
            e.generate([prompt] * batch, [params(i) for i in range(batch)])
            tpots = []
            for rep in range(2):
                outs = e.generate([prompt] * batch, [params(100 * rep + i) for i in range(batch)])
                tpots += [o.stats.decode_s / (len(o.token_ids) - 1) * 1e3 for o in outs]
            res[f"{kind} b{batch} {name}"] = round(statistics.median(tpots), 4)
            print(kind, batch, name, res[f"{kind} b{batch} {name}"], "ms", flush=True)
    del e; torch.cuda.empty_cache()
print(json.dumps(res))
