"""The one compiled part of specgguf: the lookup drafters' indexes (see _lookup.c for why).

It is optional: where no C compiler is found the build goes on without it, and the drafters
use their pure-Python indexes (the tested reference), which give the same drafts, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "specgguf.speculative.drafters._lookup",
            ["specgguf/speculative/drafters/_lookup.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
