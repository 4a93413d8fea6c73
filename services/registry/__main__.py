"""``python -m services.registry``: run the registry service until SIGTERM / SIGINT."""

import asyncio

from services.registry.service import main

if __name__ == "__main__":
    asyncio.run(main())
