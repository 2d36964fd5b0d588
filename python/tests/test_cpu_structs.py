"""The ctypes mirrors of _capi match the C structs of include/epx.h: field names and order
(parsed from the header), offsets, sizes and alignments (a C program compiled here prints
them), and the *_INIT helpers produce the bytes of the C macros. Skipped only without a C
compiler. The program includes epx.h with stub <cuda_runtime_api.h> and <nccl.h> (the structs
use neither), so neither toolkit is needed."""
import ctypes
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from epx import _capi

REPO_DIR = pathlib.Path(__file__).resolve().parents[2]
HEADER = REPO_DIR / "include" / "epx.h"


def header_structs():
    """{typedef name: [field names in order]} of every struct in epx.h."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    structs = {}
    for body, name in re.findall(r"typedef struct \w+ \{(.*?)\} (\w+);", text, flags=re.S):
        decls = [d.strip() for d in body.split(";") if d.strip()]
        structs[name] = [re.search(r"(\w+)\s*(\[[^\]]*\])?$", d).group(1) for d in decls]
    return structs


def test_every_header_struct_is_mirrored_field_for_field():
    structs = header_structs()
    assert set(structs) == set(_capi.STRUCTS)
    for name, fields in structs.items():
        assert [f for f, _ in _capi.STRUCTS[name]._fields_] == fields, name


def find_compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def c_program():
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <epx.h>",
             "static void dump(const char *name, const void *p, size_t n) {",
             "  printf(\"%s \", name);",
             "  for (size_t i = 0; i < n; i++) printf(\"%02x\", ((const unsigned char *)p)[i]);",
             "  printf(\"\\n\");", "}", "int main(void) {"]
    for name, cls in _capi.STRUCTS.items():
        lines.append('  printf("%s %%zu %%zu\\n", sizeof(%s), _Alignof(%s));' % (name, name, name))
        for field, _ in cls._fields_:
            lines.append('  printf("%s.%s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (name, field, name, field, name, field))
    for macro, (cls, _) in _capi.INITS.items():
        # static storage: the padding is zero, as in a ctypes object
        lines.append("  { static const %s v = %s; dump(\"%s\", &v, sizeof v); }" %
                     (cls.__name__, macro, macro))
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = find_compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang)")
    d = tmp_path_factory.mktemp("structs")
    (d / "cuda_runtime_api.h").write_text("typedef struct CUstream_st *cudaStream_t;\n"
                                          "typedef struct CUevent_st *cudaEvent_t;\n")
    (d / "nccl.h").write_text("typedef struct ncclComm *ncclComm_t;\n")
    (d / "layout.c").write_text(c_program())
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(d), "-I",
                    str(REPO_DIR / "include"), "-o", str(d / "layout"), str(d / "layout.c")],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.mark.parametrize("name", sorted(_capi.STRUCTS))
def test_struct_layout_matches_c(c_layout, name):
    cls = _capi.STRUCTS[name]
    assert c_layout[name] == "%d %d" % (ctypes.sizeof(cls), ctypes.alignment(cls))
    for field, ftype in cls._fields_:
        offset = getattr(cls, field).offset
        assert c_layout["%s.%s" % (name, field)] == "%d %d" % (offset, ctypes.sizeof(ftype)), \
            field


@pytest.mark.parametrize("macro", sorted(_capi.INITS))
def test_init_helpers_match_the_macros(c_layout, macro):
    cls, make = _capi.INITS[macro]
    value = make()
    assert isinstance(value, cls)
    assert bytes(value).hex() == c_layout[macro]


def test_size_fields_are_sizeof():
    for cls, make in _capi.INITS.values():
        assert make().size == ctypes.sizeof(cls)
