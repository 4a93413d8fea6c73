"""``lorafleet up``'s supervisor on real child processes: a process that exits is started again after
a doubling backoff, one that keeps crashing is left stopped and reported with its last log lines, and
the gateway's /readyz shows a missing component the supervisor is bringing back as restarting."""

import subprocess
import sys
from pathlib import Path

from lorafleet.cli.supervisor import Child, Supervisor
from services.gateway.readiness import ClusterView
from shared.schemas import SupervisedProcess, SupervisorStatus


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Program:
    """A real process running ``code``; ``start`` runs it again, as a service's restart does."""

    def __init__(self, code: str, log: Path) -> None:
        self.code, self.log, self.starts = code, log, 0
        self.proc = self.start()

    def start(self) -> subprocess.Popen:
        self.starts += 1
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", self.code], stdout=out, stderr=subprocess.STDOUT)
        return self.proc


def supervised(program: Program, clock: Clock, said: list[str], **over) -> tuple[Supervisor, Child]:
    child = Child("worker", lambda: program.proc, program.start, program.log)
    return Supervisor([child], say=said.append, clock=clock, **over), child


def test_an_exited_process_is_restarted_after_a_doubling_backoff_that_a_stable_run_resets(tmp_path):
    program = Program("import sys; sys.exit(3)", tmp_path / "worker.log")
    program.proc.wait()
    clock, said = Clock(), []
    supervisor, child = supervised(program, clock, said, backoff_s=1.0, stable_s=60.0, give_up_after=10)
    delays = []
    for _ in range(3):
        assert supervisor.poll() and child.state == "restarting"
        delays.append(child.due - clock.now)
        clock.now = child.due
        assert supervisor.poll() and child.state == "running"
        program.proc.wait()
    assert delays == [1.0, 2.0, 4.0] and program.starts == 4 and child.restarts == 3
    assert "worker exited with code 3; restart 1 in 1s" in said
    # a run that lasts past stable_s starts the backoff over
    program.code = "import time; time.sleep(30)"
    supervisor.poll()
    clock.now = child.due
    supervisor.poll()
    clock.now += 61
    assert not supervisor.poll() and child.in_a_row == 0
    program.proc.kill()
    program.proc.wait()
    supervisor.poll()
    assert child.due - clock.now == 1.0


def test_a_process_that_keeps_crashing_is_left_stopped_with_its_last_log_lines(tmp_path):
    program = Program("print('cannot open the model: no such file'); raise SystemExit(1)", tmp_path / "worker.log")
    clock, said = Clock(), []
    supervisor, child = supervised(program, clock, said, give_up_after=3, window_s=300.0)
    while child.state != "failed":
        program.proc.wait()
        supervisor.poll()
        if child.due is not None:
            clock.now = child.due
            supervisor.poll()
    assert program.starts == 3  # the first start and two restarts; the third exit ends it
    assert "cannot open the model" in child.detail and "not restarted" in child.detail
    assert any("keeps crashing" in line and "cannot open the model" in line for line in said)
    clock.now += 1000
    assert not supervisor.poll() and program.starts == 3  # no silent loop
    (status,) = supervisor.status()
    assert status.state == "failed" and status.restarts == 2


def test_readyz_shows_a_missing_component_the_supervisor_is_bringing_back():
    cluster = ClusterView(timeout_s=5.0)
    ready, components = cluster.status(catalog_loaded=True)
    assert components["workers"] == "missing" and "supervisor" not in components
    detail = "exited with code -9; restart 1 in 1s"
    cluster.on_supervisor(
        SupervisorStatus(
            host="box",
            processes=[
                SupervisedProcess(name="worker", state="restarting", restarts=0, detail=detail),
                SupervisedProcess(name="redis", state="running", restarts=1),
            ],
        )
    )
    ready, components = cluster.status(catalog_loaded=True)
    assert not ready
    assert components["workers"] == f"restarting: {detail}"
    assert components["supervisor"] == f"worker restarting: {detail}"
