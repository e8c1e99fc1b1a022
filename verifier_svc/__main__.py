from specd_core.net.service_main import model_service_main

from .config import VerifierConfig
from .server import start

if __name__ == "__main__":
    model_service_main("verifier_svc", VerifierConfig, start)
