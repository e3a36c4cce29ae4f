// A model file's identity for KV snapshots (kv/kv_snapshot.h): a snapshot records it, and a
// snapshot is loaded only into a session of a model with the same identity.
//
//   model_identity(path) = FNV-1a 64 of, in order:
//     the file's size (u64, little-endian);
//     its metadata and tensor table: GGUF, every byte before the data section (header,
//       key-value metadata, tensor infos, padding); llama2.c, the 28-byte header;
//     the first and the last 64 KiB of its tensor data (all of it when shorter), so two
//       checkpoints of one architecture and size differ too.
// Reads at most the header and 128 KiB of data; throws the Error model_format_of does for a
// path that is not a GGUF or llama2.c model.
#pragma once

#include <cstdint>
#include <string>

namespace cumulus {

uint64_t model_identity(const std::string& path);

}  // namespace cumulus
