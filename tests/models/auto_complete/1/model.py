"""auto_complete: no config.pbtxt; auto_complete_config declares the inputs and outputs.

OUTPUT0 = INPUT0 * 10 (INT32, batched up to 4), OUTPUT1 = INPUT1 as is (BYTES).
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        config.add_input({"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [2]})
        config.add_input({"name": "INPUT1", "data_type": "TYPE_STRING", "dims": [-1]})
        config.add_output({"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [2]})
        config.add_output({"name": "OUTPUT1", "data_type": "TYPE_STRING", "dims": [-1]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            outputs = [pb_utils.Tensor("OUTPUT0", in0 * 10), pb_utils.Tensor("OUTPUT1", in1)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
