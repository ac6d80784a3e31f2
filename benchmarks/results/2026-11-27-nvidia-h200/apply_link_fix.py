"""Applies a link variant of link_probe.py to setup.py's CUDA extension (on the GPU machine's throwaway copy):

    python3 apply_link_fix.py libstdcxx-first|static-libstdcxx
"""

import sys

PATCHES = {
    "libstdcxx-first": ('"fastformer._C", cpp_sources + cuda_sources,',
                        '"fastformer._C", cpp_sources + cuda_sources, libraries=["stdc++"],'),
    "static-libstdcxx": ("    link_flags = []\n", '    link_flags = ["-static-libstdc++", "-Wl,--exclude-libs,ALL"]\n'),
}
old, new = PATCHES[sys.argv[1]]
text = open("setup.py").read()
assert text.count(old) == 1, f"setup.py does not hold {old!r} once"
open("setup.py", "w").write(text.replace(old, new))
