#!/usr/bin/env python3
"""Finds import cycles between the source files of each crate in the workspace.

Usage: python3 tools/import_cycles.py [CRATE_SRC_DIR ...]
       (default: src transports/src codecs/src proto/src)

An edge a.rs -> b.rs exists when a.rs names an item (in a `use` or in an
inline path such as `crate::x::y()`) whose definition lives in b.rs.
Re-exports are followed (`pub use inner::Thing` in a mod.rs sends a user of
`parent::Thing` to inner.rs), so a folder's mod.rs that only re-exports does
not create false cycles. Inline modules (`mod tests { use super::*; }`) are
scoped to their file. `mod x;` declarations are not edges: declaring a child
is not importing it.

Prints every strongly connected component of more than one file and exits 1
when there is any, so CI can run it. Prints the file count and "no import
cycles" otherwise.
"""
import os
import re
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(src):
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'r(#*)"', src[i:])
            close = '"' + m.group(1)
            j = src.find(close, i + len(m.group(0)))
            out.append('""')
            i = n if j < 0 else j + len(close)
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'":
            # char literal or lifetime
            m = re.match(r"'(\\.|[^\\'])'", src[i:i + 4]) or re.match(r"'\\u\{[0-9a-fA-F]+\}'", src[i:i + 12]) \
                or re.match(r"'\\x[0-9a-fA-F]{2}'", src[i:i + 6])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """'a::{b, c::{d, e as f}}' -> [('a::b', 'b'), ('a::c::d', 'd'), ('a::c::e', 'f')]"""
    tree = re.sub(r"\s+", "", tree)

    def parse(s, prefix):
        res = []
        depth, start, parts = 0, 0, []
        for k, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:k])
                start = k + 1
        parts.append(s[start:])
        for p in parts:
            if not p:
                continue
            b = p.find("{")
            if b >= 0:
                head = p[:b].rstrip(":")
                inner = p[b + 1:p.rfind("}")]
                res += parse(inner, join(prefix, head))
            else:
                alias = None
                m = re.match(r"(.*)as(" + IDENT + ")$", p)
                if m and m.group(1).endswith(("::", "")) and "as" in p:
                    # split on the last 'as' that follows an identifier boundary
                    mm = re.match(r"(.*[A-Za-z0-9_\*])as(" + IDENT + ")$", p)
                    if mm and re.search(r"(^|::)" + IDENT + "$", mm.group(1)):
                        p, alias = mm.group(1), mm.group(2)
                full = join(prefix, p)
                last = full.split("::")[-1]
                if last == "self":
                    full = full[: -len("::self")]
                    last = full.split("::")[-1]
                res.append((full, alias or last))
        return res

    return parse(tree, "")


def join(a, b):
    if not a:
        return b
    if not b:
        return a
    return a + "::" + b


class Crate:
    def __init__(self, root):
        self.root = root
        self.files = {}  # module path tuple -> file
        self.text = {}
        for dirpath, _, names in os.walk(root):
            for name in names:
                if name.endswith(".rs"):
                    f = os.path.join(dirpath, name)
                    self.text[f] = strip_comments_and_strings(open(f, encoding="utf-8").read())
        for f in self.text:
            rel = os.path.relpath(f, root)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main") and len(rel) == 1:
                mod = ()
            elif rel[-1] == "mod":
                mod = tuple(rel[:-1])
            else:
                mod = tuple(rel)
            if rel[0] == "bin":
                continue  # binaries are their own crates: checked separately below
            self.files[mod] = f
        # Binaries under src/bin/NAME/ (main.rs + siblings) form their own module trees.
        self.bins = {}
        bindir = os.path.join(root, "bin")
        if os.path.isdir(bindir):
            for name in os.listdir(bindir):
                p = os.path.join(bindir, name)
                if os.path.isdir(p):
                    self.bins[name] = p
        # inline modules: file -> list of (start, end, module path)
        self.uses = defaultdict(dict)  # module path -> {name: full path}
        self.scopes = {}
        for mod, f in self.files.items():
            self.scopes[f] = self.inline_scopes(self.text[f], mod)
        for f, scopes in self.scopes.items():
            for start, end, mod in scopes:
                body = self.text[f][start:end]
                for m in re.finditer(r"\buse\s+([^;]+);", body):
                    for full, alias in expand_use_tree(m.group(1)):
                        absolute = self.absolutize(full, mod)
                        if absolute is not None and alias != "*":
                            self.uses[mod][alias] = absolute

    def inline_scopes(self, text, mod):
        """(start, end, module) spans, innermost last; the file itself first."""
        spans = [(0, len(text), mod)]
        for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", text):
            depth, i = 1, m.end()
            while i < len(text) and depth:
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                i += 1
            # module path of the inline module: its parent is the innermost enclosing span
            parent = mod
            for s, e, pm in spans:
                if s <= m.start() < e:
                    parent = pm
            spans.append((m.end(), i, parent + (m.group(1),)))
        return spans

    def absolutize(self, path, mod):
        segs = path.split("::")
        if segs[0] == "crate":
            return tuple(segs[1:])
        base = list(mod)
        if segs[0] in ("self", "super"):
            while segs and segs[0] in ("self", "super"):
                if segs[0] == "super":
                    if not base:
                        return None
                    base.pop()
                segs = segs[1:]
            return tuple(base) + tuple(segs)
        # a path relative to the current module (2018: only if the first segment is a child module
        # or an imported name); external crates otherwise
        if tuple(base) + (segs[0],) in self.files:
            return tuple(base) + tuple(segs)
        if segs[0] in self.uses.get(tuple(base), {}):
            return self.uses[tuple(base)][segs[0]] + tuple(segs[1:])
        return None

    def resolve(self, path, seen=None):
        """Absolute module path of an item -> the file that defines it."""
        seen = seen or set()
        if path in seen:
            return None
        seen.add(path)
        # longest prefix that is a file module
        for k in range(len(path), -1, -1):
            prefix = path[:k]
            if prefix in self.files or self.is_inline(prefix):
                rest = path[k:]
                if not rest:
                    return self.file_of(prefix)
                name = rest[0]
                # re-export followed
                if name in self.uses.get(prefix, {}):
                    target = self.uses[prefix][name] + rest[1:]
                    r = self.resolve(target, seen)
                    if r:
                        return r
                return self.file_of(prefix)
        return None

    def is_inline(self, mod):
        return any(m == mod for spans in self.scopes.values() for _, _, m in spans)

    def file_of(self, mod):
        if mod in self.files:
            return self.files[mod]
        for f, spans in self.scopes.items():
            for _, _, m in spans:
                if m == mod:
                    return f
        return None

    def edges(self):
        g = defaultdict(set)
        path_re = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:::" + IDENT + r")+)")
        for f, spans in self.scopes.items():
            text = self.text[f]
            for idx, (start, end, mod) in enumerate(spans):
                inner = [(s, e) for s, e, _ in spans[idx + 1:] if start <= s and e <= end]

                def in_inner(pos):
                    return any(s <= pos < e for s, e in inner)

                for m in re.finditer(r"\buse\s+([^;]+);", text[start:end]):
                    if in_inner(start + m.start()):
                        continue
                    for full, _ in expand_use_tree(m.group(1)):
                        if full.endswith("::*"):
                            full = full[:-3]
                        a = self.absolutize(full, mod)
                        if a is None:
                            continue
                        t = self.resolve(a)
                        if t and t != f:
                            g[f].add(t)
                for m in path_re.finditer(text[start:end]):
                    if in_inner(start + m.start()):
                        continue
                    a = self.absolutize(m.group(1), mod)
                    if a is None:
                        continue
                    t = self.resolve(a)
                    if t and t != f:
                        g[f].add(t)
        return g


def sccs(graph, nodes):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main():
    roots = sys.argv[1:] or ["src", "transports/src", "codecs/src", "proto/src"]
    bad, nfiles = 0, 0
    for root in roots:
        if not os.path.isdir(root):
            continue
        crate = Crate(root)
        trees = [crate]
        for name, p in crate.bins.items():
            trees.append(Crate(p))
        for c in trees:
            g = c.edges()
            nfiles += len(c.text) if c is not crate else len(c.files)
            for comp in sccs(g, sorted(c.files.values())):
                if len(comp) > 1:
                    bad += 1
                    print("cycle: " + " <-> ".join(sorted(comp)))
                    for a in sorted(comp):
                        for b in sorted(g[a]):
                            if b in comp:
                                print(f"    {a} -> {b}")
    if bad:
        print(f"{bad} import cycle(s) among {nfiles} files")
        sys.exit(1)
    print(f"no import cycles among {nfiles} files")


if __name__ == "__main__":
    main()
