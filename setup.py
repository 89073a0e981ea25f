"""The example configs travel inside the wheel as ``masrl/_examples`` (``masrl example get`` writes them out),
so that a user who installed a wheel can run the README's ``masrl train examples/quickstart.yaml``.
Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithExamples(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "examples"
        if not src.is_dir():  # an sdist without examples/: nothing to ship
            return
        dest = Path(self.build_lib) / "masrl" / "_examples"
        for path in sorted(src.rglob("*")):
            # every file: a config may name any (a prompt, a data file, a module); `masrl example get` copies them
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                target = dest / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)


setup(cmdclass={"build_py": BuildPyWithExamples})
