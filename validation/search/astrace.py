"""Summarise an OOMPROBE_AS_TRACE file: per probe child (pid), the address space mapped when the
device opened and at most, the allocations (and refusals), and what each accepted allocation
cost in address space: nothing (absorbed into an allocator block with room), its own bytes
(mapped on its own), or more (a new block)."""
import sys, collections
MiB=1<<20
lines=[l.split('\t') for l in open(sys.argv[1]).read().splitlines()]
by=collections.OrderedDict()
for pid,op,b,res,v0,v1 in lines:
    by.setdefault(pid,[]).append((op,int(b),res,int(v0),int(v1)))
for pid,ev in by.items():
    allocs=[e for e in ev if e[0]=='alloc']
    ooms=[e for e in allocs if e[2]!='ok']
    vmax=max(e[4] for e in ev)
    open_vm=ev[0][3]
    # classify alloc deltas for ok allocs
    cls=collections.Counter()
    over=0
    for op,b,res,v0,v1 in allocs:
        if res!='ok': continue
        d=v1-v0
        if d==0: cls['absorbed']+=1; over-=b
        elif d>=b and d-b<=64<<10: cls['exact']+=1; over+=d-b
        elif d>b: cls['more(%dMiB)'%((d)//MiB)]+=1; over+=d-b
        else: cls['less']+=1; over+=d-b
    print(pid, 'open %.1f MiB'%(open_vm/MiB), 'max %.1f MiB'%(vmax/MiB), 'allocs',len(allocs),'ooms',len(ooms), dict(cls), 'overhead-sum %.1f MiB'%(over/MiB))
