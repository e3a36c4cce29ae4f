// A model file and its tokenizer, loaded for the runtimes: what `generate`, `eval`, `trace`
// and the soak program open, and how a KV snapshot is matched to a model file before the
// weights load.
#pragma once

#include <memory>
#include <string>

#include "cumulus/core/dtype.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/tokenizer.h"

namespace cumulus {

struct LoadedModel {
  std::string path;
  std::string storage = "compact";  // the weights' storage: compact or f32
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
};

// GGUF (tokenizer from its metadata) or llama2.c .bin (tokenizer: `tokenizer`, else found
// beside the model). model_load_check throws the Error model_load would for a bad model or
// tokenizer path, before loading anything: not a file, not a GGUF or llama2.c model,
// --tokenizer given with a GGUF model, a llama2.c model with no tokenizer. It returns the
// model's hyperparameters (its header only).
ModelConfig model_load_check(const std::string& model, const std::string& tokenizer = "");
LoadedModel model_load(const std::string& model, const std::string& tokenizer = "",
                       WeightStorage storage = WeightStorage::compact);

// --kv-load: opens the KV snapshot at `path` (KvSnapshot::open checks the file) and checks it
// against the model file (model_identity, shapes) and the cache options, before the model
// is loaded; Session::kv_load checks the rest (the weights' storage, the prefill method)
// when it loads it.
KvSnapshot model_snapshot_open(const std::string& path, const std::string& model, int page_size, DType kv_dtype);

}  // namespace cumulus
