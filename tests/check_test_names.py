#!/usr/bin/env python3
"""Every doctest case must be one CTest test that runs it: CTest reads a
name with ';' as a list, so doctest_discover_tests registers the part before
it, whose --test-case filter matches no case, and the test passes having run
nothing. Fails naming each TEST_CASE (file:line) whose name has one.

usage: check_test_names.py TESTS_DIR"""
import os
import re
import sys

root = sys.argv[1]
bad = []
count = 0
for d, _, files in os.walk(root):
    for f in sorted(files):
        if not f.endswith((".cpp", ".h")):
            continue
        path = os.path.join(d, f)
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                for m in re.finditer(r'TEST_CASE\("((?:[^"\\]|\\.)*)"', line):
                    count += 1
                    if ";" in m.group(1):
                        bad.append(f"{os.path.relpath(path, root)}:{n}: {m.group(1)}")
for b in bad:
    print("a ';' in a test name (CTest would run none of it):", b)
print(f"{count} test cases, {len(bad)} with ';'")
sys.exit(1 if bad or count == 0 else 0)
