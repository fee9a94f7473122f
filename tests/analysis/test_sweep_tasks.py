"""run/slurm/sweep.py's reading of Slurm's array task ids: a task's own record ("3") and
the record of tasks Slurm has not split apart yet (pending: "0-3", "0,2,5-7", throttled
"0-3%2"), so pending or never-started tasks get their state, not UNKNOWN."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("wlb_sweep", ROOT / "run" / "slurm" / "sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_task_ids_of_one_task_and_of_ranges():
    assert sweep.task_ids("3") == [3]
    assert sweep.task_ids("0-3") == [0, 1, 2, 3]
    assert sweep.task_ids("0,2,5-7") == [0, 2, 5, 6, 7]
    assert sweep.task_ids("0-3%2") == [0, 1, 2, 3]
    assert sweep.task_ids("") == [] and sweep.task_ids("N/A") == []


def test_remove_empty_folders_keeps_files(tmp_path):
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "keep").mkdir()
    (tmp_path / "a" / "keep" / "f").write_text("x")
    sweep.remove_empty_folders(tmp_path / "a")
    assert (tmp_path / "a" / "keep" / "f").exists() and not (tmp_path / "a" / "b").exists()
