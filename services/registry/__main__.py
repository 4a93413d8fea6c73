"""``python -m services.registry``: run the registry service until SIGTERM / SIGINT."""

from services.registry.service import main
from shared import event_loop

if __name__ == "__main__":
    event_loop.run(main())
