// Prompt chunks: a chunk's C tokens attend in one call, their rows (query head, token) of
// the queries, the chunk the last C of the S keys; each row sees the keys up to its own.
#include <algorithm>
#include <string>

#include "ops.h"
#include "parts.h"

namespace veloxquant {

// The rest of a row's scores get a floor whose exp is 0.
void mask_causal(float* sc, int64_t R, int64_t S, int64_t C) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t seen = S - C + 1 + r % C;
    std::fill(sc + r * S + seen, sc + (r + 1) * S, -1e30f);
  }
}

void check_chunk(int causal, int64_t rows) {
  check(causal >= 0 && (causal == 0 || rows % causal == 0),
        "causal must be 0 (no mask) or the chunk's token count, dividing the query rows");
}

void check_chunk_keys(int causal, int64_t keys) {
  check(causal <= keys, "a causal chunk cannot hold more tokens than the keys");
}

}  // namespace veloxquant
