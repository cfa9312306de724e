#!/usr/bin/env python3
# The import cycles between files of src/ (non-test code: each file up to its `#[cfg(test)] mod tests`),
# from `crate::` paths: one line per strongly connected set of two or more files. Run from the
# repository root: python3 scripts/import-cycles.py
import os,re,collections,sys
# file-level import graph, non-test code only (cut at '#[cfg(test)]')
files={}
for root,_,fs in os.walk('src'):
    for f in fs:
        if f.endswith('.rs'):
            p=os.path.join(root,f); t=open(p).read()
            i=t.find('#[cfg(test)]\nmod tests')
            t=t if i<0 else t[:i]
            # Comments name modules without importing them.
            files[p]=re.sub(r'//[^\n]*','',t)
def modpath(p):
    r=os.path.relpath(p,'src')[:-3].split(os.sep)
    if r[-1]=='mod': r=r[:-1]
    return r
mods={tuple(modpath(p)):p for p in files}
g=collections.defaultdict(set)
for p,t in files.items():
    for m in re.findall(r'crate::((?:\w+::)*\w+)', t):
        parts=m.split('::')
        for k in range(len(parts),0,-1):
            if tuple(parts[:k]) in mods:
                q=mods[tuple(parts[:k])]
                if q!=p: g[p].add(q)
                break
# SCCs (Tarjan)
idx={};low={};st=[];on=set();out=[];c=[0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in g[v]:
        if w not in idx: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v:break
        if len(comp)>1: out.append(comp)
for v in list(files):
    if v not in idx: sc(v)
for comp in out: print(len(comp), sorted(comp))
