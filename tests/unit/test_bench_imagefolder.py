"""bench/imagefolder.py: the README command it runs, and the folder of generated JPEGs it builds."""

from __future__ import annotations

from PIL import Image

from dscluster.bench.imagefolder import MARKER, Options, build_folder, data_args, images_per_class, train_argv
from dscluster.files import paths


def test_each_run_is_the_readme_command_on_one_gpu_bounded_to_its_steps(tmp_path):
    opts = Options(steps=60, train_args=["optim.lr=0.001"])
    argv = train_argv("/venv/bin/mpirun", tmp_path / "h.txt", opts, data_args("imagefolder", opts, tmp_path, 0),
                      as_root=False)
    assert argv == ["/venv/bin/mpirun", "-np", "1", "--hostfile", str(tmp_path / "h.txt"), str(paths.entry_script()),
                    "--config", "configs/vit_base.yaml", "precision=fp16", "micro_batch=256", "max_steps=60",
                    "epochs=1", "checkpoint.every_epochs=0", "checkpoint.every_steps=0", "checkpoint.resume=false",
                    "data.dataset=imagefolder", f"data.path={tmp_path}", "optim.lr=0.001"]
    synthetic = data_args("synthetic", Options(classes=1000), tmp_path, 30_720)
    assert synthetic == ["data.dataset=synthetic", "data.synthetic_samples=30720", "data.num_classes=1000"]


def test_folder_holds_one_more_global_batch_than_the_steps_and_is_reused(tmp_path):
    per_class = images_per_class(global_batch=8, steps=4, classes=3)
    assert per_class * 3 >= 5 * 8
    made = build_folder(tmp_path, 3, per_class, 20, 90)
    files = sorted((tmp_path / "train").rglob("*.jpg"))
    assert made["images"] == len(files) == 3 * per_class and not made["reused"]
    assert len({f.parent.name for f in files}) == 3
    with Image.open(files[0]) as im:
        assert im.format == "JPEG" and im.size == (20, 20)
    stamp = files[0].stat().st_mtime_ns
    again = build_folder(tmp_path, 3, per_class, 20, 90)
    assert again["reused"] and files[0].stat().st_mtime_ns == stamp
    assert (tmp_path / MARKER).is_file()
    bigger = build_folder(tmp_path, 3, per_class + 1, 20, 90)  # another size: made again
    assert not bigger["reused"] and len(list((tmp_path / "train").rglob("*.jpg"))) == 3 * (per_class + 1)
