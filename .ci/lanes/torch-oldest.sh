# Lane: the oldest supported torch (pyproject's floor, what vLLM 0.20-0.26 pin), with the pinned libraries.
# bash .ci/lane torch-oldest   (a fresh .venv-lane-torch-oldest; torch 2.11.0 is a CUDA build that runs on CPU)
TORCH_PIN="torch==2.11.0"
PINS=("lightning==2.6.6" "accelerate==1.15.0" "transformers==5.24.0" "peft==0.21.2" "trl==1.16.0"
      "pytorch-lightning==2.6.6")   # test_lightning_register: `import pytorch_lightning as pl`
# shellcheck source=.ci/lanes/_engine_tests.sh
source "$(dirname "${BASH_SOURCE[0]}")/_engine_tests.sh"
TESTS=("${ENGINE_TESTS[@]}")
PYTEST_ARGS=(-n 2 --dist loadfile)
