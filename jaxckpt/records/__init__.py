"""What a root holds, as records: the storage keys, the commit marker and manifest parts,
the tree record and the pytree it describes, the data layouts, per-process state,
promotion requests, and the names read back from them (checked).

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.records import _health as health_records
from jaxckpt.records import _runs as run_records
from jaxckpt.records._keys import ATTEMPTS as ATTEMPTS
from jaxckpt.records._keys import COMMITS as COMMITS
from jaxckpt.records._keys import DATA as DATA
from jaxckpt.records._keys import LEGACY_STEPS as LEGACY_STEPS
from jaxckpt.records._keys import MAX_PACKS as MAX_PACKS
from jaxckpt.records._keys import MAX_STEP as MAX_STEP
from jaxckpt.records._keys import MIN_PACK_BYTES as MIN_PACK_BYTES
from jaxckpt.records._keys import PACK_ALIGNMENT as PACK_ALIGNMENT
from jaxckpt.records._keys import PACK_UPLOADS as PACK_UPLOADS
from jaxckpt.records._keys import PENDING as PENDING
from jaxckpt.records._keys import PROMOTE as PROMOTE
from jaxckpt.records._keys import PUBLISH as PUBLISH
from jaxckpt.records._keys import REPLICAS as REPLICAS
from jaxckpt.records._keys import ROOT_RECORD as ROOT_RECORD
from jaxckpt.records._keys import SPREAD_SLOTS as SPREAD_SLOTS
from jaxckpt.records._keys import TEMP_GRACE_S as TEMP_GRACE_S
from jaxckpt.records._keys import TIER_RECORD as TIER_RECORD
from jaxckpt.records._keys import TREE_FILE as TREE_FILE
from jaxckpt.records._keys import WRITERS as WRITERS
from jaxckpt.records._keys import MarkerRef as MarkerRef
from jaxckpt.records._keys import StepLocation as StepLocation
from jaxckpt.records._keys import check_step as check_step
from jaxckpt.records._keys import epoch_key as epoch_key
from jaxckpt.records._keys import held_manifest_name as held_manifest_name
from jaxckpt.records._keys import is_held_manifest_name as is_held_manifest_name
from jaxckpt.records._keys import is_latest_hint as is_latest_hint
from jaxckpt.records._keys import is_manifest_name as is_manifest_name
from jaxckpt.records._keys import is_stale_temp_key as is_stale_temp_key
from jaxckpt.records._keys import is_temp_key as is_temp_key
from jaxckpt.records._keys import latest_hint_key as latest_hint_key
from jaxckpt.records._keys import manifest_name as manifest_name
from jaxckpt.records._keys import marker_key as marker_key
from jaxckpt.records._keys import marker_refs_of as marker_refs_of
from jaxckpt.records._keys import new_attempt as new_attempt
from jaxckpt.records._keys import pack_count as pack_count
from jaxckpt.records._keys import pack_name as pack_name
from jaxckpt.records._keys import parse_attempt as parse_attempt
from jaxckpt.records._keys import parse_data_key as parse_data_key
from jaxckpt.records._keys import parse_epoch_key as parse_epoch_key
from jaxckpt.records._keys import parse_marker_key as parse_marker_key
from jaxckpt.records._keys import parse_pending_key as parse_pending_key
from jaxckpt.records._keys import parse_promote_key as parse_promote_key
from jaxckpt.records._keys import parse_publish_key as parse_publish_key
from jaxckpt.records._keys import parse_replica_index_key as parse_replica_index_key
from jaxckpt.records._keys import parse_replica_step as parse_replica_step
from jaxckpt.records._keys import promote_key as promote_key
from jaxckpt.records._keys import publish_key as publish_key
from jaxckpt.records._keys import replica_holdings as replica_holdings
from jaxckpt.records._keys import replica_index_key as replica_index_key
from jaxckpt.records._keys import replica_prefix as replica_prefix
from jaxckpt.records._keys import spread_slot as spread_slot
from jaxckpt.records._layoutcost import RECORDS_PER_STEP as RECORDS_PER_STEP
from jaxckpt.records._layoutcost import FormatCost as FormatCost
from jaxckpt.records._layoutcost import ProcessShare as ProcessShare
from jaxckpt.records._layoutcost import SaveRequests as SaveRequests
from jaxckpt.records._layoutcost import in_flight as in_flight
from jaxckpt.records._layouts import FORMATS as FORMATS
from jaxckpt.records._layouts import NAMES_TEXT as NAMES_TEXT
from jaxckpt.records._layouts import PACKED as PACKED
from jaxckpt.records._layouts import PLAIN as PLAIN
from jaxckpt.records._layouts import DataFormat as DataFormat
from jaxckpt.records._layouts import format_named as format_named
from jaxckpt.records._layouts import step_format as step_format
from jaxckpt.records._names import joined_key as joined_key
from jaxckpt.records._owner import claim as claim
from jaxckpt.records._owner import refusal as refusal
from jaxckpt.records._procstate import ProcessStateAccess as ProcessStateAccess
from jaxckpt.records._procstate import RestoredStates as RestoredStates
from jaxckpt.records._procstate import encode as encode_process_state
from jaxckpt.records._procsummary import summaries as process_state_summaries
from jaxckpt.records._requests import ALREADY_DURABLE as ALREADY_DURABLE
from jaxckpt.records._requests import ARCHIVED as ARCHIVED
from jaxckpt.records._requests import FAILED as FAILED
from jaxckpt.records._requests import FENCED as FENCED
from jaxckpt.records._requests import GONE as GONE
from jaxckpt.records._requests import MAX_RECEIPTS as MAX_RECEIPTS
from jaxckpt.records._requests import PARTS_WAITING as PARTS_WAITING
from jaxckpt.records._requests import PROMOTED as PROMOTED
from jaxckpt.records._requests import SUPERSEDED as SUPERSEDED
from jaxckpt.records._requests import UNSTAMPED as UNSTAMPED
from jaxckpt.records._requests import UPLOADED as UPLOADED
from jaxckpt.records._requests import WAITING as WAITING
from jaxckpt.records._requests import PromotionRequest as PromotionRequest
from jaxckpt.records._requests import PromotionResult as PromotionResult
from jaxckpt.records._requests import prune_receipts as prune_receipts
from jaxckpt.records._requests import read_requests as read_requests
from jaxckpt.records._requests import request_promotion as request_promotion
from jaxckpt.records._requests import withdraw as withdraw
from jaxckpt.records._requests import withdraw_durable as withdraw_durable
from jaxckpt.records._step import FORMAT as FORMAT
from jaxckpt.records._step import FORMAT_VERSION as FORMAT_VERSION
from jaxckpt.records._step import LAYOUTS as LAYOUTS
from jaxckpt.records._step import PLAIN_CODECS as PLAIN_CODECS
from jaxckpt.records._step import SELF_CHECKED_VERSION as SELF_CHECKED_VERSION
from jaxckpt.records._step import TRAILER_BYTES as TRAILER_BYTES
from jaxckpt.records._step import ChunkAddress as ChunkAddress
from jaxckpt.records._step import ChunkRecord as ChunkRecord
from jaxckpt.records._step import CommitMarker as CommitMarker
from jaxckpt.records._step import FileDigest as FileDigest
from jaxckpt.records._step import ManifestPart as ManifestPart
from jaxckpt.records._step import ReplicaIndex as ReplicaIndex
from jaxckpt.records._step import chunk_problem as chunk_problem
from jaxckpt.records._step import crc32c as crc32c
from jaxckpt.records._step import dumps as dumps
from jaxckpt.records._step import json_record as json_record
from jaxckpt.records._step import load_json_record as load_json_record
from jaxckpt.records._summary import PartSummary as PartSummary
from jaxckpt.records._summary import keys_hash as keys_hash
from jaxckpt.records._summary import object_keys as object_keys
from jaxckpt.records._summary import objects_of as objects_of
from jaxckpt.records._summary import parts_crc32c as parts_crc32c
from jaxckpt.records._tree import CheckedStep as CheckedStep
from jaxckpt.records._tree import SavedLeaf as SavedLeaf
from jaxckpt.records._tree import check_parts as check_parts
from jaxckpt.records._tree import np_dtype as np_dtype
from jaxckpt.records._tree import parse_tree as parse_tree
from jaxckpt.records._tree import read_checked as read_checked
from jaxckpt.records._tree import rebuild as rebuild
from jaxckpt.records._versions import versions_text as versions_text
from jaxckpt.records._versions import writer_versions as writer_versions
from jaxckpt.records._writebudget import GCS_WRITES_PER_S as GCS_WRITES_PER_S
from jaxckpt.records._writebudget import S3_WRITES_PER_PREFIX_S as S3_WRITES_PER_PREFIX_S
from jaxckpt.records._writebudget import merged_pack_limit as merged_pack_limit
from jaxckpt.records._writebudget import store_writes_per_s as store_writes_per_s
from jaxckpt.records._writebudget import uploads_within as uploads_within

if TYPE_CHECKING:
    from jaxckpt.records._pytree import MAX_NAME_CHARS as MAX_NAME_CHARS
    from jaxckpt.records._pytree import array_names as array_names
    from jaxckpt.records._pytree import chunk_shape_for as chunk_shape_for
    from jaxckpt.records._pytree import describe_state as describe_state
    from jaxckpt.records._pytree import flatten as flatten
    from jaxckpt.records._pytree import path_str as path_str
    from jaxckpt.records._pytree import storage_problem as storage_problem
    from jaxckpt.records._pytree import structure_of as structure_of
    from jaxckpt.records._pytree import unflatten_saved as unflatten_saved

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "array_names": "jaxckpt.records._pytree",
    "MAX_NAME_CHARS": "jaxckpt.records._pytree",
    "chunk_shape_for": "jaxckpt.records._pytree",
    "storage_problem": "jaxckpt.records._pytree",
    "describe_state": "jaxckpt.records._pytree",
    "flatten": "jaxckpt.records._pytree",
    "path_str": "jaxckpt.records._pytree",
    "structure_of": "jaxckpt.records._pytree",
    "unflatten_saved": "jaxckpt.records._pytree",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "ALREADY_DURABLE",
    "ARCHIVED",
    "ATTEMPTS",
    "COMMITS",
    "DATA",
    "FAILED",
    "FENCED",
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "GCS_WRITES_PER_S",
    "GONE",
    "LAYOUTS",
    "LEGACY_STEPS",
    "MAX_NAME_CHARS",
    "MAX_PACKS",
    "MAX_RECEIPTS",
    "MAX_STEP",
    "MIN_PACK_BYTES",
    "NAMES_TEXT",
    "PACKED",
    "PACK_ALIGNMENT",
    "PACK_UPLOADS",
    "PARTS_WAITING",
    "PENDING",
    "PLAIN",
    "PLAIN_CODECS",
    "PROMOTE",
    "PROMOTED",
    "PUBLISH",
    "RECORDS_PER_STEP",
    "REPLICAS",
    "ROOT_RECORD",
    "S3_WRITES_PER_PREFIX_S",
    "SELF_CHECKED_VERSION",
    "SPREAD_SLOTS",
    "SUPERSEDED",
    "TEMP_GRACE_S",
    "TIER_RECORD",
    "TRAILER_BYTES",
    "TREE_FILE",
    "UNSTAMPED",
    "UPLOADED",
    "WAITING",
    "WRITERS",
    "CheckedStep",
    "ChunkAddress",
    "ChunkRecord",
    "CommitMarker",
    "DataFormat",
    "FileDigest",
    "FormatCost",
    "ManifestPart",
    "MarkerRef",
    "PartSummary",
    "ProcessShare",
    "ProcessStateAccess",
    "PromotionRequest",
    "PromotionResult",
    "ReplicaIndex",
    "RestoredStates",
    "SaveRequests",
    "SavedLeaf",
    "StepLocation",
    "array_names",
    "check_parts",
    "check_step",
    "chunk_problem",
    "chunk_shape_for",
    "claim",
    "crc32c",
    "describe_state",
    "dumps",
    "encode_process_state",
    "epoch_key",
    "flatten",
    "format_named",
    "health_records",
    "held_manifest_name",
    "in_flight",
    "is_held_manifest_name",
    "is_latest_hint",
    "is_manifest_name",
    "is_stale_temp_key",
    "is_temp_key",
    "joined_key",
    "json_record",
    "keys_hash",
    "latest_hint_key",
    "load_json_record",
    "manifest_name",
    "marker_key",
    "marker_refs_of",
    "merged_pack_limit",
    "new_attempt",
    "np_dtype",
    "object_keys",
    "objects_of",
    "pack_count",
    "pack_name",
    "parse_attempt",
    "parse_data_key",
    "parse_epoch_key",
    "parse_marker_key",
    "parse_pending_key",
    "parse_promote_key",
    "parse_publish_key",
    "parse_replica_index_key",
    "parse_replica_step",
    "parse_tree",
    "parts_crc32c",
    "path_str",
    "process_state_summaries",
    "promote_key",
    "prune_receipts",
    "publish_key",
    "read_checked",
    "read_requests",
    "rebuild",
    "refusal",
    "replica_holdings",
    "replica_index_key",
    "replica_prefix",
    "request_promotion",
    "run_records",
    "spread_slot",
    "step_format",
    "storage_problem",
    "store_writes_per_s",
    "structure_of",
    "unflatten_saved",
    "uploads_within",
    "versions_text",
    "withdraw",
    "withdraw_durable",
    "writer_versions",
]
