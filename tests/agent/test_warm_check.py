"""What the default warm start checks in an entry point's source (:mod:`rdzv_agent.workers.warm_check`)."""

from __future__ import annotations

import pytest

from rdzv_agent.workers.warm_check import reason_to_start_cold, entry_sources

CHANGING = {
    "environ item": ("import os\nos.environ['TORCH_LOGS'] = '+dynamo'\nimport torch\n", 2),
    "environ from os": ("from os import environ\nenviron['X'] = '1'\nimport torch\n", 2),
    "environ update": ("import os\nos.environ.update(X='1')\nimport torch\n", 2),
    "environ |=": ("import os\nos.environ |= {'X': '1'}\nimport torch\n", 2),
    "del environ item": ("import os\ndel os.environ['X']\nimport torch\n", 2),
    "putenv": ("import os\nos.putenv('X', '1')\nimport torch\n", 2),
    "sys.path insert": ("import sys\nsys.path.insert(0, '/opt/torch')\nimport torch\n", 2),
    "sys.path replaced": ("import sys\nsys.path = ['/opt']\nfrom torch import nn\n", 2),
    "sys.modules item": ("import sys\nsys.modules['x'] = None\nimport torch.distributed\n", 2),
    "dlopen flags": ("import sys\nsys.setdlopenflags(258)\nimport torch\n", 2),
    "warnings filter": ("import warnings\nwarnings.filterwarnings('ignore')\nimport torch\n", 2),
    "inside if": ("import os\nif True:\n    os.environ['X'] = '1'\nimport torch\n", 2),
    "inside try": ("import os\ntry:\n    import x\nexcept ImportError:\n    os.environ['X'] = '1'\nimport torch\n", 2),
    "no torch import at all": ("import os\ndef main():\n    pass\nos.environ['X'] = '1'\n", 4),
    "class body runs": ("import os\nclass C:\n    os.environ['X'] = '1'\nimport torch\n", 2),
    "dotenv": ("from dotenv import load_dotenv\nload_dotenv()\nimport torch\n", 2),
    "a library loaded first": ("import ctypes\nctypes.CDLL('libgomp.so.1', mode=ctypes.RTLD_GLOBAL)\n"
                               "import torch\n", 2),
    "in the statement that imports": ("import os\ntry:\n    os.environ['X'] = '1'\n    import torch\n"
                                      "except ImportError:\n    pass\n", 2),
}
UNCHANGED = {
    "after torch": "import os\nimport torch\nos.environ['X'] = '1'\n",
    "imports and reads": "import os, sys\nX = os.environ.get('X')\nN = len(sys.path)\nimport numpy, torch\n",
    "in a function": "import os\ndef main():\n    os.environ['X'] = '1'\nimport torch\nif __name__ == '__main__':\n"
                     "    main()\n",
    "a local named path": "path = []\npath.append\nimport torch\n",
    "docstring and future": '"""Doc."""\nfrom __future__ import annotations\nimport torch as t\n',
    "syntax error": "import os\nos.environ[\n",
    "torch in a module-level try": "import os\ntry:\n    import torch\nexcept ImportError:\n    torch = None\n"
                                   "os.environ['X'] = '1'\n",
}
NO_TORCH = {
    "no torch": "import os, sys\nprint(os.environ)\n",
    "torch only in a function": "import os\ndef main():\n    import torch\nif __name__ == '__main__':\n    main()\n",
    "torch through another module": "from mylib.train import main\nmain()\n",
}


@pytest.mark.parametrize("name", sorted(CHANGING))
def test_a_change_before_the_torch_import_is_found_with_its_line(name):
    source, line = CHANGING[name]
    found = reason_to_start_cold([("train.py", source)])
    assert found is not None and found.startswith(f"train.py line {line}: "), found


@pytest.mark.parametrize("name", sorted(UNCHANGED))
def test_nothing_is_found_where_the_import_sees_what_it_would_cold(name):
    assert reason_to_start_cold([("train.py", UNCHANGED[name])]) is None


@pytest.mark.parametrize("name", sorted(NO_TORCH))
def test_an_entry_point_without_a_module_level_torch_import_is_a_reason(name):
    assert reason_to_start_cold([("train.py", NO_TORCH[name])]) == "train.py does not import torch at module level"


def test_a_module_entry_reads_its_packages_first(tmp_path):
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("import os\nos.environ['FROM_INIT'] = '1'\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import torch\n")
    (pkg / "train.py").write_text("import torch\n")
    for entry in ("pkg.sub.train", "pkg.sub"):
        sources = entry_sources("module", entry, [str(tmp_path)])
        assert sources is not None and sources[0][0] == str(tmp_path / "pkg" / "__init__.py")
        found = reason_to_start_cold(sources)
        assert found is not None and found.startswith(f"{tmp_path / 'pkg' / '__init__.py'} line 2"), found
    assert [name for name, _ in entry_sources("module", "pkg.sub", [str(tmp_path)])][-1] == \
        str(pkg / "__main__.py")
    assert entry_sources("module", "pkg.missing", [str(tmp_path)]) is None
    assert entry_sources("script", str(tmp_path / "nope.py"), []) is None
    assert entry_sources("code", "import torch", []) == [("-c", "import torch")]
