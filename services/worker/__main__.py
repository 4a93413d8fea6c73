from shared.openmp_env import default_spin_count

default_spin_count()  # before torch loads GNU OpenMP, which reads it once

from services.worker.service import main  # noqa: E402

if __name__ == "__main__":  # vLLM's engine core is a spawned child: importing this module must not start a worker
    main()
