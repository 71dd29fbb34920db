// tokenmill::lora_add_ as a C++ call (cpu_lora.cpp), for the decode loop (cpu_decode.cpp): its 120
// calls a step skip the dispatcher's boxing of five tensor lists.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tokenmill {

void lora_add_cpu(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                  const at::Tensor& slots, const c10::optional<std::vector<at::Tensor>>& spans,
                  const c10::optional<std::vector<at::Tensor>>& packed);

}  // namespace tokenmill
