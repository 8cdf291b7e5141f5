#!/usr/bin/env python3
"""The layers the build declares, checked against the includes the sources write (ctest `layers`).

Each source folder of the library is one CMake component (ferry_add_component); its LINK list names the
components below it. CMake writes that graph at configure time (one line per component:
`folder: dep_folder dep_folder ...`, the direct links). This check reads every C++ file of the
repository and fails when:

  1. a library file includes a header of a folder that is not its own and not below it (transitively
     through the links): a lower layer including an upper one, or two siblings including each other;
  2. an include written with quotes does not name a file relative to the including file: every
     include must resolve from a fresh clone, without a build (editors, code-structure tools);
  3. a library file includes <ferry/...>: that prefix exists only in an installed tree and in the
     build tree's link; inside the library includes are relative;
  4. the layer block of docs/ARCHITECTURE.md (between `<!-- layers:begin -->` and `<!-- layers:end -->`,
     lines `folder -> dep, dep`) differs from the build's graph.

`--self-test` proves the check can fail: it copies the tree, adds a wrong include to a lower layer, and
expects exactly that violation.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
SOURCES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
SKIP_DIRS = {".git", "third_party", "node_modules"}


def read_graph(path):
    graph = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            folder, _, deps = line.partition(":")
            graph.setdefault(folder.strip(), set()).update(d for d in deps.split() if d)
    for folder, deps in graph.items():
        for d in deps:
            if d not in graph:
                raise SystemExit(f"check_layers: the graph names {d} (below {folder}), which is no component")
    return graph


def closure(graph):
    below = {}

    def visit(folder, stack):
        if folder in below:
            return below[folder]
        if folder in stack:
            raise SystemExit("check_layers: the build's component graph has a cycle: " + " -> ".join(stack + [folder]))
        seen = set()
        for d in graph[folder]:
            seen.add(d)
            seen |= visit(d, stack + [folder])
        below[folder] = seen
        return seen

    for folder in graph:
        visit(folder, [])
    return below


def cpp_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build"))
        for name in sorted(filenames):
            if name.endswith(SOURCES):
                yield os.path.join(dirpath, name)


def check(root, graph, architecture=None):
    root = os.path.realpath(root)
    below = closure(graph)
    problems = []
    for path in cpp_files(root):
        rel = os.path.relpath(path, root)
        own = rel.split(os.sep)[0] if os.sep in rel else None
        in_library = own in graph
        with open(path, errors="replace") as f:
            text = f.read()
        for m in INCLUDE.finditer(text):
            kind, name = m.group(1), m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            where = f"{rel}:{line}"
            if kind == "<":
                if in_library and name.startswith("ferry/"):
                    problems.append(f"{where}: <{name}>: inside the library includes are relative "
                                    f"(\"../folder/{os.path.basename(name)}\"), so that they resolve from a clone")
                continue
            target = os.path.realpath(os.path.join(os.path.dirname(path), name))
            if not os.path.isfile(target):
                problems.append(f"{where}: \"{name}\" names no file relative to {os.path.dirname(rel) or '.'}/ "
                                f"(includes must resolve from a fresh clone, without a build)")
                continue
            if not in_library or not target.startswith(root + os.sep):
                continue
            to = os.path.relpath(target, root).split(os.sep)[0]
            if to == own:
                continue
            if to not in graph:
                problems.append(f"{where}: the library folder {own}/ includes {os.path.relpath(target, root)}, "
                                f"outside every component")
            elif to not in below[own]:
                problems.append(f"{where}: {own}/ includes {os.path.relpath(target, root)}, but {to}/ is not below "
                                f"{own}/ (it links {', '.join(sorted(below[own])) or 'nothing'}): a lower layer must "
                                f"not include an upper one")
    if architecture:
        problems += check_architecture(architecture, graph)
    return problems


def check_architecture(path, graph):
    with open(path) as f:
        text = f.read()
    m = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.DOTALL)
    if not m:
        return [f"{path}: no layer block (<!-- layers:begin --> ... <!-- layers:end -->)"]
    doc = {}
    for line in m.group(1).splitlines():
        line = line.strip().strip("`")
        if "->" not in line:
            continue
        folder, _, deps = line.partition("->")
        folder = folder.strip().rstrip("/")
        doc[folder] = {d.strip().rstrip("/") for d in deps.split(",") if d.strip() and d.strip() != "(nothing)"}
    problems = []
    for folder in sorted(set(graph) | set(doc)):
        if graph.get(folder) != doc.get(folder):
            problems.append(f"{path}: layer block says {folder} -> {sorted(doc.get(folder, []))}, the build links "
                            f"{folder} -> {sorted(graph.get(folder, []))}")
    return problems


def self_test(root, graph):
    """A wrong include in the lowest layer must be found; the unchanged tree must pass."""
    lowest = min(graph, key=lambda f: len(closure(graph)[f]))
    highest = max(graph, key=lambda f: len(closure(graph)[f]))
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "tree")
        shutil.copytree(root, copy, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", "build*", "third_party", "benchmarks", "results"))
        upper = next(p for p in cpp_files(os.path.join(copy, highest)) if p.endswith(".h"))
        victim = next(p for p in cpp_files(os.path.join(copy, lowest)) if p.endswith(".cpp"))
        with open(victim, "a") as f:
            f.write(f'\n#include "../{highest}/{os.path.basename(upper)}"\n')
        found = [p for p in check(copy, graph) if os.path.basename(victim) in p]
        if len(found) != 1 or "must not include an upper one" not in found[0]:
            return [f"self-test: a wrong include in {lowest}/ was not reported as such: {found}"]
        print(f"check_layers: self-test: {found[0]}")
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the repository root")
    ap.add_argument("--graph", required=True, help="the component graph CMake wrote")
    ap.add_argument("--architecture", help="docs/ARCHITECTURE.md, whose layer block must match the graph")
    ap.add_argument("--self-test", action="store_true", help="also prove a wrong include is found")
    args = ap.parse_args()
    graph = read_graph(args.graph)
    problems = check(args.root, graph, args.architecture)
    if args.self_test and not problems:
        problems = self_test(args.root, graph)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} problem(s)")
        return 1
    below = closure(graph)
    print("check_layers: ok: " + "; ".join(f"{f} -> {', '.join(sorted(graph[f])) or '(nothing)'}"
                                          for f in sorted(graph, key=lambda f: len(below[f]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
