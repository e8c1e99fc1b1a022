from specd_core.net.service_main import model_service_main

from .config import DrafterConfig
from .server import start

if __name__ == "__main__":
    model_service_main("drafter_svc", DrafterConfig, start)
