"""gs:// URLs served from a local directory, for tests of URL workdirs without a network.

A workdir URL is reached by two layers: `etils.epath` (orbax's path type, and everything else of
the workdir) goes through fsspec's "gcs" filesystem, and orbax hands array data to TensorStore's
own GCS driver. `served_from(root)` replaces both: fsspec's "gcs" becomes `root` (its first folder
is the bucket), TensorStore gets a "file" spec under `root`, and orbax's bucket-layout query (a
GCS API call) answers "flat namespace". Everything above those two calls runs as it does on GCS
(orbax's commit files instead of renames, epath's object-store code paths).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from unittest import mock

from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from eppo_jax import workdir

_fsspec_registry = importlib.import_module("fsspec.registry")


def _clear_epath_cache() -> None:
  # epath keeps one filesystem per protocol; drop it so the next URL finds the current one.
  # pylint: disable-next=protected-access
  type(epath_backend.fsspec_backend)._get_filesystem.cache_clear()


@contextlib.contextmanager
def served_from(root):
  """Within the block, gs://BUCKET/PATH is the local `root/BUCKET/PATH`."""
  root = os.fspath(root)

  class Buckets(DirFileSystem):
    protocol = ("gcs", "gs")
    cachable = False  # fsspec would hand out an instance of an earlier root otherwise.

    def __init__(self, *args, **kwargs):
      del args, kwargs  # epath passes GCS options (finalize_on_close).
      super().__init__(path=root, fs=LocalFileSystem(auto_mkdir=True))

  def tensorstore_spec(path):
    bucket, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
    return {"driver": "file", "path": os.path.join(root, bucket, key)}

  _clear_epath_cache()
  try:
    with mock.patch.dict(_fsspec_registry._registry, {"gcs": Buckets}), \
         mock.patch.object(gcs_utils, "get_kvstore_for_gcs", tensorstore_spec), \
         mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False), \
         mock.patch.object(workdir, "URL_PACKAGES", {}):  # gcsfs is not needed for this one.
      yield
  finally:
    _clear_epath_cache()
