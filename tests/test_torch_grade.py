"""Exercise torch.op (common/torch_exercise.py, graded by common/torch_grade.py): the starting file's
TODOs, `make exercise CH=torch`, the grade's refusals without PyTorch; on a GPU with PyTorch, the
solution PASSes every check, the starting file FAILs every check with its TODO, and a solution that
hands 09's backward autograd's dO as it comes fails where that dO is not contiguous. The
solution is the starting file with each TODO block replaced (SOLUTION below), run by the grader
as a student's file would be."""
import re

import pytest

from test_torch_op import run_hidden

# The code of each TODO(n) block, from its comment to its `raise`, in the solution.
SOLUTION = {
    1: "    torch_op.check_inputs(q=q, k=k, v=v)\n    return torch_op.run_forward(FORWARD, q, k, v, causal, scale)\n",
    2: "    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)\n",
    3: ("    torch_op.check_inputs(q=q, k=k, v=v, o=o, d_o=d_o)\n"
        "    return torch_op.run_backward(BACKWARD, q, k, v, o, lse, d_o, causal, scale, True)\n"),
    4: ("    q, k, v, o, lse = ctx.saved_tensors\n"
        "    dq, dk, dv = attention_backward_op(q, k, v, o, lse, grad_o.contiguous(), ctx.causal, ctx.scale)\n"
        "    return dq, dk, dv, None, None\n"),
}
TODO_BLOCK = r"    # TODO\({n}\).*?\n    raise NotImplementedError\([^\n]*\)\n"


def start_text(repo):
    return (repo.root / "common" / "torch_exercise.py").read_text()


def solved(text, solution=SOLUTION):
    for n, code in solution.items():
        text, count = re.subn(TODO_BLOCK.format(n=n), lambda _: code, text, flags=re.S)
        assert count == 1, f"TODO({n}): {count} blocks in the starting file, expected 1"
    return text


def test_starting_file_has_four_todos(repo):
    text = start_text(repo)
    assert sorted(int(n) for n in re.findall(r"# TODO\((\d)\)", text)) == [1, 2, 3, 4]
    assert not re.search(r"# TODO\(|NotImplementedError", solved(text)), "the solution leaves a TODO"


def test_make_exercise_writes_the_copy_and_keeps_edits(repo, tmp_path):
    body = ("import torch_grade\n"
            f"torch_grade.COPY = {str(tmp_path / 'attention_op.py')!r}\n"
            "print(torch_grade.make_copy(False))\n"
            "open(torch_grade.COPY, 'a').write('# mine\\n')\n"
            "print(torch_grade.make_copy(False))\n"
            "print(torch_grade.make_copy(True))\n")
    proc = run_hidden(repo, body)
    assert [line for line in proc.stdout.splitlines() if line in ("0", "2")] == ["0", "2", "0"], proc.stdout
    assert "has your edits" in proc.stderr and "FORCE=1" in proc.stderr, proc.stderr
    assert (tmp_path / "attention_op.py").read_text() == start_text(repo)


def test_grade_without_torch_is_ungraded(repo):
    proc = run_hidden(repo, "import torch_grade\nsys.exit(torch_grade.main(['grade']))\n")
    assert proc.returncode == 77 and proc.stdout == "UNGRADED torch.op: PyTorch not found (pip install torch)\n", (
        proc.returncode, proc.stdout, proc.stderr)


def grade(repo, tmp_path, text):
    path = tmp_path / "attention_op.py"
    path.write_text(text)
    return repo.run([repo.python, repo.root / "common" / "torch_grade.py", "grade", path, "--build", repo.build],
                    timeout=600)


def graded_lines(proc):
    return [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]


@pytest.fixture
def gpu_torch(repo, torch):
    import torch_op
    for name in ("07", "09"):
        if not (repo.build / "lib" / f"{torch_op.build_name(name)}.so").is_file():
            pytest.skip(f"{torch_op.build_name(name)}'s library is not built: run make lib")
    return torch


@pytest.mark.gpu
def test_solution_passes(repo, tmp_path, gpu_torch):
    proc = grade(repo, tmp_path, solved(start_text(repo)))
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "PASS torch.op", proc.stdout + proc.stderr
    assert len(graded_lines(proc)) == 9 and all(line.startswith("ok") for line in graded_lines(proc)), proc.stdout


@pytest.mark.gpu
def test_starting_file_fails_every_check_with_its_todo(repo, tmp_path, gpu_torch):
    proc = grade(repo, tmp_path, start_text(repo))
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    lines = graded_lines(proc)
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1].startswith("FAIL torch.op: 9 of 9 checks failed"), (
        proc.stdout + proc.stderr)
    assert all(line.startswith("FAIL") and "TODO: exercise torch.op" in line for line in lines), proc.stdout


@pytest.mark.gpu
def test_a_backward_fed_autograds_do_fails_where_do_is_not_contiguous(repo, tmp_path, gpu_torch):
    """Without .contiguous() the backward op refuses autograd's dO where it is not contiguous: the two
    non-contiguous-dO checks, and opcheck, whose AOT test hands the backward an expanded (stride 0) dO."""
    wrong = {**SOLUTION, 4: SOLUTION[4].replace("grad_o.contiguous()", "grad_o")}
    proc = grade(repo, tmp_path, solved(start_text(repo), wrong))
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    failed = [line.split(":")[0] for line in graded_lines(proc) if line.startswith("FAIL")]
    assert proc.returncode == 1 and len(failed) == 4 and all("dO not contiguous" in f or "opcheck" in f
                                                              for f in failed), proc.stdout + proc.stderr
