#!/usr/bin/env python3
"""Compiles chosen translation units of a GCC build again with Clang, syntax only, warnings as errors.

GCC accepts some C++20 in -std=c++17 without a word, even under -Wpedantic: a lambda that captures a
structured binding (`auto [x, y] = ...; f([&] { use(x); })`) is the case that broke the Clang build of
the examples and benchmarks (D96). A user who builds ferry, or copies an example, with Clang gets an
error there. This check takes each chosen file's command from the build's compile_commands.json,
swaps the compiler for clang++, drops what only GCC knows, and runs it with -fsyntax-only -Werror (the
build's own warnings, -Wall -Wextra; torch's headers stay -isystem and quiet).

  check_clang.py --compile-commands build/compile_commands.json [--select /examples/ ...] [--self-test]

--select keeps the entries whose path contains any of the given strings (all entries without one).
--self-test first compiles two small files that GCC takes and Clang must refuse (a captured structured
binding; an unused lambda capture under -Werror), so the check is seen to fail.
Exit status: 0 all compiled, 1 a file did not, 77 no clang++ here (ctest: skipped).
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# Flags of the GCC build that Clang does not know (it warns, and -Werror would make that an error).
GCC_ONLY = {"-Wno-maybe-uninitialized"}
# Flags with a value that name the compiler's outputs: syntax only writes none.
DROP_WITH_VALUE = {"-o", "-MT", "-MF", "-MQ"}
DROP = {"-c", "-MD", "-MMD"}


def clang_argv(entry, clang):
    argv = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out = [clang]
    skip = False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg in DROP_WITH_VALUE:
            skip = True
            continue
        if arg in DROP or arg in GCC_ONLY or arg == entry["file"]:
            continue
        out.append(arg)
    return out + ["-fsyntax-only", "-Werror", entry["file"]]


def compile_one(argv, cwd):
    start = time.monotonic()
    r = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return r.returncode, r.stdout, time.monotonic() - start


SELF_TEST_CASES = {
    "captured_binding.cpp": "#include <utility>\n"
                            "int f() { auto [a, b] = std::pair<int, int>{1, 2}; return [&] { return a + b; }(); }\n",
    "unused_capture.cpp": "int g(int v) { return [v] { return 1; }(); }\n",
}


def self_test(clang, template):
    """Each case must fail under the flags of a real entry, or the check could not see its bug."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in SELF_TEST_CASES.items():
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write(text)
            argv = clang_argv(template, clang)[:-1] + [path]  # the entry's flags, this file
            rc, out, _ = compile_one(argv, template["directory"])
            if rc == 0:
                print(f"check_clang: self-test FAILED: {name} compiled; the check cannot see that bug")
                return False
    print(f"check_clang: self-test ok ({len(SELF_TEST_CASES)} cases refused)")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-commands", required=True)
    ap.add_argument("--select", action="append", default=[])
    ap.add_argument("--clang", default="clang++")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()

    clang = shutil.which(a.clang)
    if clang is None:
        print(f"check_clang: skipped: no {a.clang} on PATH")
        return 77
    with open(a.compile_commands) as f:
        entries = [e for e in json.load(f) if e["file"].endswith((".cpp", ".cc", ".cxx"))]
    if a.select:
        entries = [e for e in entries if any(s in e["file"] for s in a.select)]
    if not entries:
        print(f"check_clang: no entry of {a.compile_commands} matches {a.select}")
        return 1
    version = subprocess.run([clang, "--version"], stdout=subprocess.PIPE, text=True).stdout.splitlines()[0]
    print(f"check_clang: {len(entries)} files with {version}")
    if a.self_test and not self_test(clang, entries[0]):
        return 1

    failed = []
    for e in sorted(entries, key=lambda e: e["file"]):
        rc, out, seconds = compile_one(clang_argv(e, clang), e["directory"])
        print(f"  {'ok  ' if rc == 0 else 'FAIL'} {seconds:5.1f} s  {os.path.relpath(e['file'])}")
        if rc != 0:
            failed.append(e["file"])
            print(out)
    if failed:
        print(f"check_clang: {len(failed)} of {len(entries)} files do not compile with Clang: {failed}")
        return 1
    print(f"check_clang: ok ({len(entries)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
