import numpy as np

from adapters import kernels_for


def test_sigmoid_at_zero_is_one_half(request):
    kernels = kernels_for(request.config.getoption("--engine-device"))
    assert kernels.sigmoid(np.float32(0)) == np.float32(0.5)
