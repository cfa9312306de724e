#!/usr/bin/env python3
"""Import cycles between the files of src/ (the library crate; test code left out).

Prints one line per strongly connected set of two or more files, with one cycle through it, and
exits 1 when there is any (0 when there is none). Run from the repository root:

    python3 scripts/import-cycles.py [--strict] [--modules] [--edges FILE]

--edges FILE prints FILE's resolved imports (and why each) instead. --strict also counts a
folder's mod.rs calling into its own children (see below). --modules looks for cycles between
the top-level modules (`src/a.rs`, `src/a/`) instead of files, from the same edges.

How an import becomes an edge between two files:
- Every path is resolved to the file that defines what it names: `crate::a::b::Item`,
  `super::b::Item`, `self::b::Item`, `b::Item` (a child module, or a module brought in by `use`)
  walk the module tree (`a/b.rs` or `a/b/mod.rs`) as far as it goes; the item's file is the last
  module's file. Paths are read from `use` lines (groups `{..}` included) and from code.
- Re-exports are looked through: when that file only re-exports the item (`pub use x::Item`,
  `pub use x::*`, `pub use x::Item as Other`), the path is followed to the file that defines it.
  A `pub use` line makes an edge from the re-exporting file only when that file also uses the
  name in its own code; a parent declaring `mod child;` is no edge.
- A `use` of a module (`use crate::workload::parallel;`) makes no edge by itself: the paths that
  go through it (`parallel::local_shape`) do. A glob import (`use x::*`) is an edge to x's file.
- A folder's mod.rs (or lib.rs) calling into its own child modules is no edge: the parent
  declares its children, defines the types they share and dispatches to them, and the children
  use those types; that pair is Rust's usual shape, not a circle. Everything else counts: two
  siblings, a child and a module outside its folder, two modules. --strict counts it too.
- Test code is left out: every item under `#[cfg(test)]` (a `mod tests { .. }`, or a `mod tests;`
  file). Comments and string literals are skipped. src/main.rs is another crate and left out.
"""
import collections
import os
import sys

SRC = 'src'
ITEM_KEYWORDS = {'fn', 'struct', 'enum', 'trait', 'type', 'const', 'static', 'union', 'mod'}


# ---- lexing ---------------------------------------------------------------------------------
def lex(text):
    """Identifiers, `::` and one-character punctuation; comments, strings, chars and numbers go."""
    toks, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith('//', i):
            j = text.find('\n', i)
            i = n if j < 0 else j
        elif text.startswith('/*', i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith('/*', i):
                    depth, i = depth + 1, i + 2
                elif text.startswith('*/', i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == '"' or (c == 'b' and text.startswith('b"', i)):
            i = text.index('"', i) + 1
            while text[i] != '"':
                i += 2 if text[i] == '\\' else 1
            i += 1
        elif (c == 'r' or text.startswith('br', i)) and _raw_string_at(text, i):
            j = i + (2 if c == 'b' else 1)
            hashes = 0
            while text[j] == '#':
                hashes, j = hashes + 1, j + 1
            end = '"' + '#' * hashes
            i = text.index(end, j + 1) + len(end)
        elif c == "'" or (c == 'b' and text.startswith("b'", i)):
            j = i + (2 if c == 'b' else 1)
            if text[j] == '\\':
                j += 2
                while text[j] != "'":
                    j += 1
                i = j + 1
            elif j + 1 < n and text[j + 1] == "'":
                i = j + 2
            else:  # a lifetime
                i = j
                while i < n and (text[i].isalnum() or text[i] == '_'):
                    i += 1
        elif c.isalpha() or c == '_':
            j = i
            while j < n and (text[j].isalnum() or text[j] == '_'):
                j += 1
            word = text[i:j]
            if word == 'r' and text.startswith('#', j):  # r#ident
                k = j + 1
                while k < n and (text[k].isalnum() or text[k] == '_'):
                    k += 1
                word, j = text[j + 1:k], k
            toks.append(word)
            i = j
        elif c.isdigit():
            while i < n and (text[i].isalnum() or text[i] in '_.') and not text.startswith('..', i):
                i += 1
        elif text.startswith('::', i):
            toks.append('::')
            i += 2
        else:
            toks.append(c)
            i += 1
    return toks


def _raw_string_at(text, i):
    j = i + (2 if text[i] == 'b' else 1)
    while j < len(text) and text[j] == '#':
        j += 1
    return j < len(text) and text[j] == '"' and (j > i + 1 or text[i] in 'rb')


def is_ident(t):
    return t[0].isalpha() or t[0] == '_'


def skip_item(toks, i):
    """Index just past the item starting at i (its attributes included)."""
    depth = 0
    while i < len(toks):
        t = toks[i]
        if t in '{([':
            depth += 1
        elif t in '})]':
            depth -= 1
            if depth == 0 and t == '}':
                return i + 1
        elif t == ';' and depth == 0:
            return i + 1
        i += 1
    return i


def strip_test_items(toks):
    """Drop every item under #[cfg(test)]; return (tokens, names of `mod x;` files dropped)."""
    out, dropped, i = [], set(), 0
    pattern = ['#', '[', 'cfg', '(', 'test', ')', ']']
    while i < len(toks):
        if toks[i:i + 7] == pattern:
            j = skip_item(toks, i + 7)
            item = toks[i + 7:j]
            if 'mod' in item and item[-1] == ';':
                dropped.add(item[item.index('mod') + 1])
            i = j
        else:
            out.append(toks[i])
            i += 1
    return out, dropped


# ---- use trees ------------------------------------------------------------------------------
def parse_use_tree(toks, i, prefix, out):
    """Parse a use tree at toks[i]; append (segments, alias, glob) to out; return the next index."""
    segs = list(prefix)
    while True:
        t = toks[i]
        if t == '{':
            i += 1
            while toks[i] != '}':
                i = parse_use_tree(toks, i, segs, out)
                if toks[i] == ',':
                    i += 1
            return i + 1
        if t == '*':
            out.append((segs, None, True))
            return i + 1
        if t == '::':
            i += 1
            continue
        segs.append(t)
        i += 1
        if toks[i] == '::':
            i += 1
            continue
        alias = None
        if toks[i] == 'as':
            alias, i = toks[i + 1], i + 2
        if segs[-1] == 'self':  # `a::{self}` names a itself
            segs = segs[:-1]
            alias = alias or (segs[-1] if segs else None)
        out.append((segs, alias or segs[-1], False))
        return i


class File:
    def __init__(self, path, module, toks):
        self.path, self.module = path, module
        self.uses = []  # (segments, local name, glob, public)
        self.code = []  # tokens outside use lines
        self.items = set()  # names defined at the file's top level
        depth, i = 0, 0
        while i < len(toks):
            t = toks[i]
            if t == 'use' and (i == 0 or toks[i - 1] != '::'):
                public = 'pub' in toks[max(0, i - 5):i] and toks[i - 1] in ('pub', ')')
                entries = []
                j = parse_use_tree(toks, i + 1, [], entries)
                for segs, name, glob in entries:
                    self.uses.append((segs, name, glob, public))
                i = j + 1  # past the `;`
                continue
            if t == '{':
                depth += 1
            elif t == '}':
                depth -= 1
            elif depth == 0 and t in ITEM_KEYWORDS and i + 1 < len(toks) and is_ident(toks[i + 1]):
                self.items.add(toks[i + 1])
            elif depth == 0 and t == 'macro_rules' and i + 2 < len(toks):
                self.items.add(toks[i + 2])
            self.code.append(t)
            i += 1
        self.code_names = {t for t in self.code if is_ident(t)}


# ---- the crate ------------------------------------------------------------------------------
def module_of(path):
    parts = os.path.relpath(path, SRC)[:-3].split(os.sep)
    if parts[-1] in ('mod', 'lib'):
        parts = parts[:-1]
    return tuple(parts)


def load_crate():
    files, dropped = {}, set()
    for root, _, names in os.walk(SRC):
        for name in sorted(names):
            path = os.path.join(root, name)
            if not name.endswith('.rs') or path == os.path.join(SRC, 'main.rs'):
                continue
            toks, test_mods = strip_test_items(lex(open(path, encoding='utf-8').read()))
            f = File(path, module_of(path), toks)
            files[f.module] = f
            dropped |= {f.module + (m,) for m in test_mods}
    for m in dropped:
        files.pop(m, None)
    return files


class Resolver:
    def __init__(self, files):
        self.files = files

    def absolute(self, f, segs):
        """The crate path a path written in f stands for, or None (another crate)."""
        first, rest = segs[0], list(segs[1:])
        if first == 'crate':
            return list(rest)
        if first in ('self', 'super'):
            base = list(f.module)
            while segs and segs[0] in ('self', 'super'):
                if segs[0] == 'super':
                    base = base[:-1]
                segs = segs[1:]
            return base + list(segs)
        if tuple(f.module) + (first,) in self.files:
            return list(f.module) + list(segs)
        for useg, name, glob, _ in f.uses:
            if not glob and name == first:
                target = self.absolute(f, useg) if useg and useg[0] != first else None
                return None if target is None else target + rest
        return None

    def resolve(self, segs, seen=()):
        """(file, is_module) for an absolute crate path."""
        mod = ()
        for k, seg in enumerate(segs):
            if mod + (seg,) in self.files:
                mod += (seg,)
                continue
            f, rest = self.files[mod], list(segs[k + 1:])
            key = (mod, seg)
            if key in seen or seg in f.items:
                return f, False
            for useg, name, glob, public in f.uses:
                if public and not glob and name == seg:
                    target = self.absolute(f, useg)
                    if target is not None:
                        return self.resolve(target + rest, seen + (key,))
            for useg, _, glob, public in f.uses:
                if public and glob:
                    target = self.absolute(f, useg)
                    if target is not None:
                        found, is_mod = self.resolve(target + [seg] + rest, seen + (key,))
                        if seg in found.items or is_mod:
                            return found, is_mod
            return f, False
        return self.files[mod], True

    def edges(self, f):
        """{target file path: first import seen} for one file."""
        out = {}

        def add(segs, how):
            target = self.absolute(f, segs)
            if target is None:
                return
            g, is_mod = self.resolve(target)
            if g is not f and not is_mod:
                out.setdefault(g.path, how)

        for segs, name, glob, public in f.uses:
            if not segs:
                continue
            how = 'use ' + '::'.join(segs) + ('::*' if glob else '')
            if glob:
                target = self.absolute(f, segs)
                if target is None:
                    continue
                g, _ = self.resolve(target)
                if g is not f and (not public or g.items & f.code_names):
                    out.setdefault(g.path, how)
            elif not public or name in f.code_names:
                add(segs, how)
        code, i = f.code, 0
        while i < len(code):
            if is_ident(code[i]) and i + 2 < len(code) and code[i + 1] == '::' and (
                    i == 0 or code[i - 1] != '::'):
                j = i
                segs = [code[j]]
                while j + 2 < len(code) and code[j + 1] == '::' and is_ident(code[j + 2]):
                    j += 2
                    segs.append(code[j])
                add(segs, '::'.join(segs))
                i = j + 1
            else:
                i += 1
        return out


def cycles(graph):
    """Strongly connected sets of two or more nodes (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def one_cycle(graph, comp):
    """A shortest cycle through the set's first file, staying inside the set."""
    start, inside = comp[0], set(comp)
    prev, queue = {start: None}, collections.deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in inside and w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def owns(f, files, path):
    """Whether `path` is a child module of f's module (f is its parent's mod.rs or lib.rs)."""
    return any(m[:-1] == f.module and g.path == path for m, g in files.items() if m)


def main(argv):
    strict, modules = '--strict' in argv, '--modules' in argv
    argv = [a for a in argv if a not in ('--strict', '--modules')]
    files = load_crate()
    resolver = Resolver(files)
    graph, why = {}, {}
    for f in files.values():
        e = resolver.edges(f)
        if not strict:
            e = {g: how for g, how in e.items() if not owns(f, files, g)}
        graph[f.path] = set(e)
        why.update({(f.path, g): how for g, how in e.items()})
    if len(argv) == 3 and argv[1] == '--edges':
        for g in sorted(graph[argv[2]]):
            print(f'{argv[2]} -> {g}  ({why[(argv[2], g)]})')
        return 0
    if modules:
        # The same edges between top-level modules (`src/a.rs`, `src/a/...` are module `a`).
        top = lambda path: os.path.relpath(path, SRC).split(os.sep)[0].removesuffix('.rs')
        mgraph, mwhy = collections.defaultdict(set), {}
        for a, targets in graph.items():
            mgraph[top(a)]
            for b in targets:
                if top(a) != top(b):
                    mgraph[top(a)].add(top(b))
                    mwhy.setdefault((top(a), top(b)), f'{a} -> {b}: {why[(a, b)]}')
        graph, why = mgraph, mwhy
    found = cycles(graph)
    for comp in found:
        print(f'{len(comp)} {"modules" if modules else "files"}: {" ".join(comp)}')
        path = one_cycle(graph, comp)
        for a, b in zip(path, path[1:]):
            print(f'    {a} -> {b}  ({why[(a, b)]})')
    sys.stdout.flush()
    if found:
        print(f'{len(found)} import cycle(s) between {"modules" if modules else "files"}',
              file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
