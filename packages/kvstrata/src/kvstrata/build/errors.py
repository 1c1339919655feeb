"""Errors of `kvstrata.build`: a memory system that cannot be built as asked.

Every one is raised before any pool or allocator is created.
"""

from __future__ import annotations


class BuildError(Exception):
    """Base of every error of `kvstrata.build`."""


class UnknownFamily(BuildError, ValueError):
    """A model family this module cannot build (choices: `kvstrata.build.FAMILIES`)."""


class UnknownPolicy(BuildError, ValueError):
    """An eviction policy the tree does not have (choices: `kvstrata.build.POLICIES`)."""


class InvalidCapacity(BuildError, ValueError):
    """A capacity, page size or slot count out of range (non-positive, or too small to hold
    one page)."""


class InvalidModel(BuildError, ValueError):
    """A model config of another family, or one the pools refuse (layer layout, sizes, dtype)."""


class DeviceUnavailable(BuildError, ValueError):
    """A device string torch does not parse, or a CUDA device on a machine without one."""


class TiersUnsupported(BuildError, ValueError):
    """A tier combination the hierarchical cache refuses for this family (its InvalidConfig,
    e.g. storage under an SWA tree before unified-radix-cache wired it). The message says which
    and why."""


class UnknownArchitecture(InvalidModel):
    """A Hugging Face config whose `model_type` (and `architectures`) no reader knows; the
    message lists the known ones."""


class MissingConfigField(InvalidModel):
    """A Hugging Face config without a field its family needs; the message names the field
    (with its `text_config.` prefix when the model nests one) and the architecture."""


class BudgetTooSmall(InvalidCapacity):
    """A device budget that cannot hold one request of the configured context; the message
    gives the budget, what each part takes and what one request needs."""


class HostMemoryExceeded(InvalidCapacity):
    """A host tier larger than the free host memory; the message gives both figures."""
