"""The blob store a process's settings name: what the ingest's CAS sink writes and the
web UI's downloads read (both take :class:`~conveyor_runtime.settings.BlobStoreSettings`)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from conveyor_runtime.settings import BlobStoreSettings

from conveyor_bep.blobs import BlobStore, DiskStore
from conveyor_bep.s3 import S3Store


@dataclass(frozen=True, slots=True)
class ConfiguredStore:
    """Where blobs live (``store``) and where uploads are staged (``root``: the blobs
    themselves on disk, or only the uploads in progress with S3)."""

    root: Path
    store: BlobStore

    def close(self) -> None:
        """Release the store's connections (an S3 client's)."""
        self.store.close()


def open_store(settings: BlobStoreSettings) -> ConfiguredStore | None:
    """The store ``settings`` configure, or None: no CAS sink (no ``bep_blob_root`` and
    not S3)."""
    if settings.bep_blob_store == "s3":
        secret = settings.bep_s3_secret_access_key
        store: BlobStore = S3Store(
            settings.bep_s3_endpoint or "",
            settings.bep_s3_bucket or "",
            access_key_id=settings.bep_s3_access_key_id or "",
            secret_access_key=secret.get_secret_value() if secret else "",
            region=settings.bep_s3_region,
        )
        root = Path(settings.bep_blob_root or Path(tempfile.gettempdir()) / "conveyor-bep")
        return ConfiguredStore(root, store)
    if settings.bep_blob_root:
        root = Path(settings.bep_blob_root)
        return ConfiguredStore(root, DiskStore(root))
    return None
