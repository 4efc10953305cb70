import shutil
import tempfile

import pytest
import torch

from elmo_pipeline import BiLM
from support import data_path


_TEMP_FOLDER = pytest.MonkeyPatch()
_OWN_TEMP_FOLDER = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes its factory of session folders
def pytest_configure(config):
    """$TMPDIR, for this process and the ones it starts, is a folder of the session's own right in
    the temp folder, removed when the session ends, set before any test module imports Beam, whose
    model server takes its folder when imported. Beam leaves in $TMPDIR what no test can take
    away: a Pipeline built and never run (every refusal when built) keeps its beam-pipeline-temp*,
    and a job on Beam's default runner leaves two empty tmp*, a beam-temp* and
    beam-requirements-cache; the suite left some 2,000 of them in /tmp, session after session.
    Not in pytest's session folder: multiprocessing makes its sockets (a DataLoader's workers pass
    tensors by them) two folders down in $TMPDIR, a socket's path has at most 107 bytes, and there
    a temp folder of 61 characters left no room (the workers hung). xdist's workers keep their
    controller's. Tests that check what our commands leave there give them a $TMPDIR of their own."""
    if hasattr(config, "workerinput"):  # its $TMPDIR, inherited, is the folder its controller made
        return
    config._tmp_path_factory.getbasetemp()  # pytest's session folder stays in the user's temp folder
    folder = tempfile.mkdtemp(prefix="elmo-tests-")
    _TEMP_FOLDER.setattr(tempfile, "tempdir", folder)
    _TEMP_FOLDER.setenv("TMPDIR", folder)
    config.stash[_OWN_TEMP_FOLDER] = folder


def pytest_unconfigure(config):
    _TEMP_FOLDER.undo()
    if _OWN_TEMP_FOLDER in config.stash:  # the controller, or a session without workers
        shutil.rmtree(config.stash[_OWN_TEMP_FOLDER], ignore_errors=True)


@pytest.fixture(scope="session")
def elmo_fixture_dir():
    return data_path("allennlp_elmo")


@pytest.fixture(scope="session")
def reference_model(elmo_fixture_dir):
    """The small trained biLM of the original implementation (cell 64, projection 16, clips 3)."""
    d = elmo_fixture_dir
    return BiLM.from_allennlp(str(d / "options.json"), str(d / "lm_weights.hdf5")).eval()


@pytest.fixture(scope="session")
def model_arg(elmo_fixture_dir) -> str:
    """The reference model as `--model OPTIONS.json,WEIGHTS.hdf5` for extract and its transforms."""
    return f"{elmo_fixture_dir / 'options.json'},{elmo_fixture_dir / 'lm_weights.hdf5'}"


@pytest.fixture(scope="session")
def wikitext_pack(tmp_path_factory):
    """The first 300 lines of each WikiText-2 split, packed as a lent GPU's training reads them
    (benchmarks/gpu_train_default.py pack: two Beam prepare jobs, so shared): (folder, pack.json)."""
    from benchmarks import gpu_train_default

    folder = tmp_path_factory.mktemp("wikitext_pack") / "pack"
    return folder, gpu_train_default.pack(folder, data_path("wikitext2").parent, max_lines=300)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
