"""The training core: the blocks every run is made of, behind the one face other packages import.

Config and its checks, the run's shape, precision, model, data, the step, communication and
synchronisation live in this package's modules. plan, bench, check and the command line reach
them only through the names below (`from dscluster import core`, then `core.load_config(...)`);
train builds its loop on the modules themselves. A name loads its module on first use, so that
importing the face costs no torch and light commands start fast.
"""

import importlib

# face name -> (module of this package, its name there)
_FACE = {
    # config and its checks
    "ModelConfig": ("config", "ModelConfig"),
    "load_config": ("config", "load_config"),
    "to_yaml": ("config", "to_yaml"),
    "ConfigValueError": ("config_checks", "ConfigValueError"),
    "compression_conflict": ("config_checks", "compression_conflict"),
    "sync_conflict": ("config_checks", "sync_conflict"),
    # the run's shape: batch, shares, data shape
    "RunShape": ("shape", "RunShape"),
    "DeviceFacts": ("shape", "DeviceFacts"),
    "resolve_shape": ("shape", "resolve"),
    "data_shape": ("shape", "data_shape"),
    "resolve_batching": ("balanced", "resolve_batching"),
    "plan_shares": ("balanced", "plan_shares"),
    # precision
    "FORMATS": ("precision", "FORMATS"),
    "decide_here": ("precision", "decide_here"),
    "gradient_format": ("precision", "gradient_format"),
    "recommend_initial_scale_power": ("losscale", "recommend_initial_scale_power"),
    "write_initial_scale_power": ("losscale", "write_initial_scale_power"),
    # model
    "SMALL_IMAGE": ("model", "SMALL_IMAGE"),
    "build_model": ("model", "build_model"),
    "count_params": ("model", "count_params"),
    # data and its cache
    "load_data": ("data", "load"),
    "default_workers": ("loader", "default_workers"),
    "workers_for": ("loader", "workers_for"),
    "CacheChoice": ("datacache", "CacheChoice"),
    "FILL_CHUNK": ("datacache", "FILL_CHUNK"),
    "choose_cache": ("datacache", "choose"),
    "fill_cache": ("datacache", "fill"),
    "cache_split_bytes": ("datacache", "split_bytes"),
    "memory_available": ("datacache", "mem_available"),
    # the step: how it is timed, and measuring it on this machine
    "WARMUP_STEPS": ("timing", "WARMUP_STEPS"),
    "StepWindow": ("timing", "StepWindow"),
    "is_timed": ("timing", "is_timed"),
    "warmup_left_out": ("timing", "warmup_left_out"),
    "probe_key": ("probe", "probe_key"),
    "compiles_here": ("probe", "compiles_here"),
    "host_load": ("probe", "host_load"),
    "measure_steady_compute": ("probe", "measure_steady_compute"),
    "measure_powersgd": ("probe", "measure_powersgd"),
    "fault_ms": ("probe", "fault_ms"),
    "faults_for_rank": ("faults", "for_rank"),
    "start_up_gc": ("startgc", "start_up"),
    # communication and synchronisation
    "powersgd_start": ("comm", "powersgd_start"),
    "SYNC_PERIODS": ("syncmode", "PERIODS"),
    "sync_label": ("syncmode", "label"),
    "parse_sync_label": ("syncmode", "parse_label"),
    "parse_sync_stream": ("syncmode", "parse_stream"),
    "sync_stream_label": ("syncmode", "stream_label"),
    "sync_paste_args": ("syncmode", "paste_args"),
    "evaluation_sharded": ("syncmode", "evaluation_sharded"),
    "PEER_FAILURE": ("guards", "PEER_FAILURE"),
    "is_primary": ("dist", "is_primary"),
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    # looked up on every use, not cached: a test that patches the defining module is seen here too
    if name not in _FACE:
        raise AttributeError(f"module 'dscluster.core' has no attribute {name!r}")
    module, attribute = _FACE[name]
    return getattr(importlib.import_module(f"dscluster.core.{module}"), attribute)


def __dir__() -> list[str]:
    return __all__
