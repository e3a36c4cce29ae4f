// The paths a command reads and writes, checked together before any work: none empty (an
// unset shell variable must not mean "not given"), no output the same file as an input or
// as another output (core/file.h, file_check_distinct).
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "cumulus/core/file.h"

namespace cumulus::cli {

// Refuses an empty value for every path option of every subcommand of `app` (by name:
// --model, --tokenizer, --prompt-file, --text, --json, --markdown, --svg-dir, --kv-save,
// --kv-load, --out, --profile), as CLI11's validation error naming the option.
void paths_refuse_empty(CLI::App& app);

// file_check_distinct over a command's paths; a llama2.c model's tokenizer found beside it
// counts as an input too.
void paths_check_distinct(std::vector<FilePathUse> paths);

// A --kv-load snapshot's weights (its setup's "weights=" part: "F32" or the block formats)
// against --weights, before the model is loaded: `--weights f32` dequantises every tensor,
// so a snapshot of a quantised run cannot match it, and the reverse. Throws Error naming both.
void snapshot_weights_check(const std::string& snapshot_path, const std::string& snapshot_setup,
                            const std::string& model_path, const std::string& weights);

}  // namespace cumulus::cli
