"""Cluster runs in /tmp/cl: per seed, DDP vs the default vs bf16: final loss, train time,
time to DDP's final loss (evals' train_time_s, linear between evals? no: first eval at or
below), to DDP's +1%, bytes whole run vs DDP, step times per phase."""
import glob, json, sys
rows = {}
for f in sorted(glob.glob('/tmp/cl/*.json')):
    d = json.load(open(f))
    seed = d['meta']['seed']
    for r in d['rows']:
        name = r['method'] if r['method'] == 'ddp_adam' else f"{r['method']}:{f.split('/')[-1].split('-')[1].split('.')[0]}"
        rows.setdefault(seed, {})[name] = (r, d['meta'])
def first_time(r, target):
    for e in r['evals']:
        if e['val_loss'] <= target:
            return e['train_time_s']
    return None
print('| seed | run | final loss (vs DDP) | train s | vs DDP | to DDP final | to DDP+1% | bytes/rank whole run | vs DDP | warm / comp s/step |')
print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
for seed, rs in sorted(rows.items()):
    ddp = rs.get('ddp_adam', (None,))[0]
    if ddp is None: continue
    dl, dt = ddp['final_val_loss'], ddp['train_time_s']
    dfin = first_time(ddp, dl); d1 = first_time(ddp, 1.01 * dl)
    dbytes = sum(ddp.get('bytes_warmup', 0) for _ in [0])
    for name, (r, meta) in rs.items():
        steps = r['phases']
        nw = sum(1 for p in steps if p == 'warmup'); nc = len(steps) - nw
        b = (r.get('bytes_warmup') or 0) * nw + (r.get('bytes_compression') or 0) * nc
        if name == 'ddp_adam':
            ddp_bytes = b
        t_fin = first_time(r, dl); t1 = first_time(r, 1.01 * dl)
        rows[seed][name] = (r, meta, b, t_fin, t1)
    ddp_bytes = rows[seed]['ddp_adam'][2]
    for name, (r, meta, b, t_fin, t1) in rows[seed].items():
        fl = r['final_val_loss']
        print(f"| {seed} | {name} | {fl:.4f} ({(fl/dl-1)*100:+.1f}%) | {r['train_time_s']:.1f} | {dt/r['train_time_s']:.2f}x | "
              f"{(dfin/t_fin if t_fin else float('nan')):.2f}x | {(d1/t1 if t1 else float('nan')):.2f}x | {b/1e6:.1f} MB | {ddp_bytes/b:.1f}x | "
              f"{r.get('step_time_warmup') or 0:.3f} / {r.get('step_time_compression') or 0:.3f} |")
