"""Post-training INT8 quantization of a trained checkpoint (xDeepServe §4.7, CloudMatrix-Infer
§4.5): calibration statistics (`calibrate.py`), SmoothQuant smoothing (`smoothing.py`), GPTQ
(`gptq.py`), the quantized checkpoint (`quantize.py`) and the accuracy ablation (`evaluate.py`).
The INT8 kernels the dies run are in xds_mpi/model/qlinear.py."""
