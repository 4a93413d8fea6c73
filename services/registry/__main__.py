"""``python -m services.registry``: run the registry service until SIGTERM / SIGINT."""

from services.registry.service import main

if __name__ == "__main__":
    main()
