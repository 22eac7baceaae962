"""zpslaunch.slurm - the slurm launcher: one `srun` job step per fleet process, inside an
allocation (salloc/sbatch); stopping srun ends the job step.
"""
import shlex


def wrap(argv, host, args, job):
    """The srun command that runs argv as a one-task step on host."""
    return (shlex.split(args.srun) + ["--nodes=1", "--ntasks=1", f"--nodelist={host}",
                                      f"--job-name={job}"]
            + shlex.split(args.srun_args or "") + argv)
