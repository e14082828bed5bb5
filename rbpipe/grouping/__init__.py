"""Shared grouping: a manager-backed torchrl ``MCAdvantage`` that moves handles, not payloads."""

from rbpipe.grouping.bridge import StdlibBridge, bridged_reduce
from rbpipe.grouping.claims import Claim, ClaimLostWarning
from rbpipe.grouping.manager import (
    GroupingManager,
    ManagerDiedError,
    connect_manager,
    manager_address,
    open_registry,
    start_manager,
)
from rbpipe.grouping.registry import GroupRegistry
from rbpipe.grouping.staging import Staging, StagingError
from rbpipe.grouping.transform import SharedMCAdvantage

__all__ = ["SharedMCAdvantage", "Claim", "ClaimLostWarning", "GroupRegistry", "GroupingManager", "start_manager",
           "connect_manager", "manager_address", "open_registry", "Staging", "StagingError", "StdlibBridge",
           "bridged_reduce", "ManagerDiedError"]
