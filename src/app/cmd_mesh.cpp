// `wlb mesh DECK`: build the 4D mesh on the MPI job, exercise a collective on every
// group and print the rank layout. The world size must equal tp*cp*pp*dp.
#include <mpi.h>

#include <cstdio>
#include <iostream>
#include <vector>

#include "app/command.hpp"
#include "parallel/mesh.hpp"

namespace {
struct Opts {
  wlb::app::DeckArgs deck;
};

const bool registered = wlb::app::registerCommand(
    "mesh", "Build the TP x CP x PP x DP mesh on this MPI job and print each rank's coordinates",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      return [o]() -> int {
        const wlb::Deck deck = o->deck.load("wlb mesh");
        const auto shape = wlb::parallel::MeshShape::fromDeck(deck.mesh);
        wlb::parallel::Mesh mesh(shape, MPI_COMM_WORLD);
        // One all-reduce per group: every group must sum to its size.
        const wlb::parallel::Comm* groups[] = {&mesh.tp(), &mesh.cp(), &mesh.pp(), &mesh.dp(), &mesh.cpTp()};
        std::vector<int> row{mesh.rank(), mesh.coord().tp, mesh.coord().cp, mesh.coord().pp, mesh.coord().dp};
        for (const auto* g : groups) {
          int one = 1, sum = 0;
          MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, *g);
          row.push_back(sum == g->size() ? g->size() : -1);
        }
        row.push_back(mesh.ppPrev());
        row.push_back(mesh.ppNext());
        std::vector<int> all(row.size() * static_cast<std::size_t>(shape.size()));
        MPI_Gather(row.data(), static_cast<int>(row.size()), MPI_INT, all.data(), static_cast<int>(row.size()),
                   MPI_INT, 0, mesh.world());
        if (mesh.rank() == 0) {
          std::printf("mesh %s\n", shape.describe().c_str());
          std::printf("%5s %3s %3s %3s %3s | %7s %7s %7s %7s %7s | %7s %7s\n", "rank", "tp", "cp", "pp", "dp",
                      "|tp|", "|cp|", "|pp|", "|dp|", "|cp*tp|", "pp_prev", "pp_next");
          for (int r = 0; r < shape.size(); ++r) {
            const int* x = &all[static_cast<std::size_t>(r) * row.size()];
            auto nb = [](int v) { return v == MPI_PROC_NULL ? std::string("-") : std::to_string(v); };
            std::printf("%5d %3d %3d %3d %3d | %7d %7d %7d %7d %7d | %7s %7s\n", x[0], x[1], x[2], x[3], x[4], x[5],
                        x[6], x[7], x[8], x[9], nb(x[10]).c_str(), nb(x[11]).c_str());
          }
        }
        return 0;
      };
    });
}  // namespace
