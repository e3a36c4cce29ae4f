// Model files and their tokenizers for the runtimes (model/model_load.h).
#include "cumulus/model/model_load.h"

#include <filesystem>

#include "core/check.h"
#include "cumulus/core/file.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_identity.h"

namespace cumulus {

namespace {

// The llama2.c tokenizer a model uses: `given`, else the one beside the model.
std::string llama2c_tokenizer_path(const std::string& model, const std::string& given, int32_t vocab_size) {
  if (!given.empty()) return given;
  const std::string found = tokenizer_find_llama2c(model, vocab_size);
  if (found.empty()) {
    std::string dir = std::filesystem::path(model).parent_path().string();
    if (dir.empty()) dir.assign(1, '.');  // (assign: GCC 12 -Wrestrict false positive on = ".")
    CUMULUS_FAIL("llama2.c model '{}' has no tokenizer beside it (looked for {}/tok{}.bin and {}/tokenizer.bin): "
                 "give --tokenizer",
                 model, dir, vocab_size, dir);
  }
  return found;
}

}  // namespace

ModelConfig model_load_check(const std::string& model, const std::string& tokenizer) {
  const ModelConfig c = model_config_load(model);
  if (c.format == ModelFormat::gguf) {
    CUMULUS_CHECK(tokenizer.empty(),
                  "--tokenizer '{}' given with the GGUF model '{}', which carries its own tokenizer: drop --tokenizer",
                  tokenizer, model);
  } else {
    file_check_regular(llama2c_tokenizer_path(model, tokenizer, c.vocab_size), "llama2c tokenizer");
  }
  return c;
}

LoadedModel model_load(const std::string& model, const std::string& tokenizer, WeightStorage storage) {
  const ModelConfig c = model_load_check(model, tokenizer);
  LoadedModel m;
  m.path = model;
  m.storage = storage == WeightStorage::f32 ? "f32" : "compact";
  m.weights = model_weights_load(model, storage);
  if (c.format == ModelFormat::gguf) {
    m.tokenizer = tokenizer_from_gguf(GgufFile::open(model));
  } else {
    m.tokenizer = tokenizer_from_llama2c(llama2c_tokenizer_path(model, tokenizer, c.vocab_size), c.vocab_size);
  }
  return m;
}

KvSnapshot model_snapshot_open(const std::string& path, const std::string& model, int page_size, DType kv_dtype) {
  KvSnapshot snap = KvSnapshot::open(path);
  const ModelConfig c = model_config_load(model);
  KvSnapshotInfo want = snap.info();  // the setup is the session's to check
  want.model_id = model_identity(model);
  want.n_layers = c.n_layers;
  want.n_heads = c.n_heads;
  want.n_kv_heads = c.n_kv_heads;
  want.head_dim = c.head_dim;
  want.vocab_size = c.vocab_size;
  want.page_size = page_size;
  want.dtype = kv_dtype;
  try {
    snap.check(want);
  } catch (const Error& e) {
    CUMULUS_FAIL("--kv-load with model '{}': {}", model, e.message());
  }
  return snap;
}

}  // namespace cumulus
