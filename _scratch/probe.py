import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tests.mp import run_ranks

def fn(rank, world):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    ddp = DDP(m, bucket_cap_mb=0.00005)
    out = []
    def hook(state, bucket):
        b = bucket.buffer()
        ps = bucket.parameters()
        gs = bucket.gradients()
        off = 0; ok = True
        for p, g in zip(ps, gs):
            v = b[off:off + p.numel()].view_as(p); off += p.numel()
            ok &= (g.data_ptr() == v.data_ptr())
        out.append((bucket.index(), bucket.is_last(), [tuple(p.shape) for p in ps], ok, b.numel(), off))
        fut = torch.futures.Future()
        b.div_(world); dist.all_reduce(b); fut.set_result(b)
        return fut
    ddp.register_comm_hook(None, hook)
    for it in range(3):
        ddp(torch.randn(2, 4)).sum().backward()
        out.append("--")
    return out, hasattr(ddp, "_comm_hooks")

if __name__ == "__main__":
    print(run_ranks(2, fn)[0])
