from services.worker.service import main

if __name__ == "__main__":  # vLLM's engine core is a spawned child: importing this module must not start a worker
    main()
