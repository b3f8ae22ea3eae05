"""The host check of batch ids before jit (issue 32, bad #9; `trainer/data/ids.py`)."""

import numpy as np
import pytest

from trainer.data import ids as data_ids


def test_the_host_check_refuses_what_jit_would_wrap():
  data_ids.check_int32({"inputs": np.zeros((2, 3), np.int32),
                        "targets": np.array([[-1, 2**31 - 1]], np.int64),
                        "weights": np.ones(2, np.float32)})
  with pytest.raises(ValueError, match=r"^batch\['targets'\] holds 4294967301 \(int64\), "
                     r"outside int32: jax would wrap it to 5 under jit"):
    data_ids.check_int32({"targets": np.array([[2**32 + 5, 1]], np.int64)})
  with pytest.raises(ValueError, match=r"holds -2147483649"):
    data_ids.check_int32({"exclude": np.array([-(2**31) - 1], np.int64)})
  with pytest.raises(ValueError, match=r"holds 4294967295 \(uint32\)"):
    data_ids.check_int32({"targets": np.array([2**32 - 1], np.uint32)})
