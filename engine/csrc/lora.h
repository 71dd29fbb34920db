// tokenmill::lora_add_ as a C++ call (cpu_lora.cpp), for the decode loop (cpu_decode.cpp): its 120
// calls a step skip the dispatcher's boxing of five tensor lists, and take each layer's operands as
// views of the step's lists (no copies).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tokenmill {

// Each list: one tensor per adapter of the call (spans, packed: or empty for none), as the ops take them.
void lora_add_cpu(at::Tensor& y, const at::Tensor& x, c10::ArrayRef<at::Tensor> a, c10::ArrayRef<at::Tensor> bt,
                  const at::Tensor& slots, c10::ArrayRef<at::Tensor> spans, c10::ArrayRef<at::Tensor> packed);

}  // namespace tokenmill
