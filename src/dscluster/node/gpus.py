"""Which GPUs a node's processes see: the one rule that `check` and the telemetry sampler share."""

from __future__ import annotations


def visible_indices(cuda_visible: str | None, uuids: list[str | None]) -> list[int]:
    """Which of the machine's GPUs (NVML order) this node's processes see, by CUDA_VISIBLE_DEVICES.

    NVML and nvidia-smi list every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, so two
    lab nodes on one host (or a user who gave a node's jobs GPUs 2,3) would each sample all of
    them. Entries are indices or UUID prefixes (GPU-..., MIG-...); as in CUDA, an entry that names
    no GPU ends the list. Unset: every GPU. Indices are read in NVML's (PCI bus) order, which is
    CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if cuda_visible is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for token in (t.strip() for t in cuda_visible.split(",")):
        if token.isdigit() and int(token) < len(uuids):
            found = int(token)
        else:
            found = next((i for i, u in enumerate(uuids) if token and u and u.startswith(token)), None)
        if found is None or found in out:
            break
        out.append(found)
    return out
